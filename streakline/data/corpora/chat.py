"""The chat prompt set that ships with streakline: short single-turn requests an instruction-tuned assistant gets.

The prompts are written for this project and live here as data (a module, so an installed package carries them with
no package-data setting). They back two built-in benchmarks (``streakline/data/benchmarks.py``): ``tiny-chat``, the
``heldout`` split, is an evaluation set; ``tiny-chat-train``, the ``train`` split, is where trajectories sample
training prompts, so a drafter trained on it is never measured on its own training prompts (the splits are disjoint,
and ``stage=trajectories`` refuses an overlap unless ``data.allow_eval_overlap``). A model that has a chat template
sees each prompt as one user turn (``streakline.data.sources.prompt_for``).

    from streakline.data.corpora.chat import chat_prompts
    chat_prompts("heldout")             # 24 prompts: [{"kind": "explain", "text": "..."}, ...]
    chat_prompts("train")               # 48 prompts, none of them in "heldout"

Each kind (explain, write, list, summarise, rewrite, howto, code, advice) has six training prompts and three held-out
ones, so both splits cover every kind, and the kinds take turns in each split.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/data/test_benchmarks.py -k chat
"""

from __future__ import annotations

SPLITS = ("train", "heldout")

# kind -> (six training prompts, three held-out prompts). Order within a split is fixed: record ids are positions.
_PROMPTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "explain": (
        (
            "Explain in a short paragraph why the sky looks blue during the day.",
            "What is compound interest? Give a small example with numbers.",
            "Explain the difference between weather and climate to a ten-year-old.",
            "In two or three sentences, what does a computer's RAM do?",
            "Why do we have leap years?",
            "What is the difference between a virus and a bacterium?",
        ),
        (
            "Explain what inflation is and why prices rise over time.",
            "How does a refrigerator keep food cold? Keep it simple.",
            "What is photosynthesis, in plain words?",
        ),
    ),
    "write": (
        (
            "Write a short email to my landlord asking when the broken heater will be repaired.",
            "Write a two-sentence birthday message for a coworker I don't know well.",
            "Draft a polite message declining an invitation to a wedding because I will be travelling.",
            "Write a four-line poem about a rainy Monday morning.",
            "Write a short thank-you note to a teacher who helped my son with reading.",
            "Write a one-paragraph product description for a reusable water bottle.",
        ),
        (
            "Write a short email to a customer apologising that their order will arrive three days late.",
            "Write a friendly reminder to my team that the project report is due on Friday.",
            "Write a short cover letter opening for a junior accountant position.",
        ),
    ),
    "list": (
        (
            "List five ideas for a rainy-day activity with young children.",
            "Give me six names for a small bakery that sells sourdough bread.",
            "List some inexpensive ways to make a small apartment feel bigger.",
            "Suggest five topics for a ten-minute talk at a school science club.",
            "What are four healthy snacks I can take to work?",
            "List five questions I could ask at the end of a job interview.",
        ),
        (
            "List five ways to save money on groceries.",
            "Suggest four hobbies that someone could start with almost no equipment.",
            "Give me five ideas for a weekend trip that does not need a car.",
        ),
    ),
    "summarise": (
        (
            "Summarise in one sentence: The town council met on Tuesday and agreed to extend the library's opening "
            "hours on weekends. The change starts next month and will be paid for by cutting the budget for new "
            "street signs.",
            "Summarise this in a single line: Our quarterly sales grew by eight percent, mostly thanks to online "
            "orders, while sales in physical stores stayed flat. We plan to open no new stores this year.",
            "Give a one-sentence summary: Bees visit flowers to collect nectar, and while doing so they carry "
            "pollen from one plant to another, which lets many crops produce fruit.",
            "Summarise the main point: The new phone has a larger battery and a better camera, but it is heavier "
            "than last year's model and costs a hundred dollars more.",
            "Condense this into one sentence: The hiking trail will be closed from June to August while workers "
            "rebuild two bridges that were damaged in the spring floods.",
            "Summarise briefly: Regular short walks after meals can help control blood sugar, and even ten minutes "
            "makes a measurable difference for many people.",
        ),
        (
            "Summarise in one sentence: The museum will offer free entry on the first Sunday of every month, "
            "starting in March, to encourage families who rarely visit to come and explore the collection.",
            "Give a one-line summary: The study followed two thousand adults for ten years and found that those who "
            "slept fewer than six hours a night reported more colds.",
            "Summarise the key point: The company will let employees work from home three days a week, but teams "
            "must meet in the office every Wednesday.",
        ),
    ),
    "rewrite": (
        (
            "Rewrite this more politely: Send me the files now, I've been waiting all day.",
            "Make this sentence shorter: Due to the fact that it was raining, we made the decision to stay indoors.",
            "Rewrite in simple English: The municipality has commenced the rehabilitation of the thoroughfare.",
            "Fix the grammar: Me and him goes to the market every saturdays.",
            "Rewrite this to sound more formal: Hey, can you let me know if the meeting's still on?",
            "Turn this into a bulleted list: We need eggs, flour, two lemons, butter and a bag of sugar.",
        ),
        (
            "Rewrite this more politely: Your report is late again and it's full of mistakes.",
            "Make this clearer and shorter: At this point in time we are not in a position to offer a refund.",
            "Fix the spelling and grammar: Their going too the park tomorow if it dont rain.",
        ),
    ),
    "howto": (
        (
            "How do I boil an egg so the yolk is soft?",
            "What are the steps to change a flat tyre on a bicycle?",
            "How can I get a stubborn stain out of a cotton shirt?",
            "Give me simple steps to start a small herb garden on a balcony.",
            "How do I back up the photos on my phone?",
            "What is a good way to learn vocabulary in a new language?",
        ),
        (
            "How do I make a simple tomato sauce for pasta?",
            "What steps should I follow to prepare for a job interview?",
            "How can I fall asleep faster at night?",
        ),
    ),
    "code": (
        (
            "In Python, how do I reverse a list? Explain the options briefly.",
            "What is the difference between a list and a tuple in Python?",
            "Describe in words how binary search works.",
            "What does a for loop do, and when would I use a while loop instead?",
            "How would you check whether a word is a palindrome? Explain the idea, then show a short Python function.",
            "What is a variable in programming? Explain for a complete beginner.",
        ),
        (
            "In Python, how do I count how many times each word appears in a sentence?",
            "Explain what a function is in programming and why it is useful.",
            "What is the difference between an error and a warning when a program runs?",
        ),
    ),
    "advice": (
        (
            "I have three exams next week. How should I plan my study time?",
            "Should I buy a laptop or a tablet for taking notes at university? Give the main pros and cons.",
            "How can I politely tell a friend that I need some time alone this weekend?",
            "What should I pack for a two-day hiking trip in spring?",
            "I keep forgetting to drink water during the day. Any tips?",
            "What are some good habits for keeping a tidy desk at work?",
        ),
        (
            "How can I stay focused when working from home?",
            "What should I consider before adopting a dog?",
            "I am nervous about speaking in public. How can I prepare for a short presentation?",
        ),
    ),
}


def chat_prompts(split: str) -> list[dict[str, str]]:
    """The prompts of ``split`` (``"train"`` or ``"heldout"``) as ``{"kind", "text"}``.

    Kinds take turns (the first prompt of each kind, then the second of each, ...), so any prefix, as a ``limit``
    takes it, spreads over every kind instead of holding only explanations.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown chat split {split!r}; expected one of {', '.join(SPLITS)}")
    index = SPLITS.index(split)
    columns = [[{"kind": kind, "text": text} for text in splits[index]] for kind, splits in _PROMPTS.items()]
    return [row for rank in zip(*columns, strict=True) for row in rank]
