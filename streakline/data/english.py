"""How much of a text is English words: the share of its words found in a list of common English words.

A cheap, deterministic judge of language (no model, no download), for filters that must tell a request a person
might type from noise of the same shape: self-chat's (``data/self_chat.py``) keeps a request only when enough of
its words are known. The list below is some 1,500 frequent English words and the words requests use (code, data,
writing, travel, health, business, school); a word also counts when it is a list word with a regular ending
(``-s``, ``-es``, ``-ed``, ``-ing``, ``-er``, ``-est``, ``-ly``, ``-'s``, ``n't``, ``-ies``, ...). Pieces without
letters (numbers, ``2+2``, ``$12``) count neither way; a piece that mixes letters with digits or underscores
(``ny3c__``) is a word that is not known.

    known_share("How do I sort a list in Python?")       # 1.0
    known_share("__ ny3c__ it ta son mores andSfh3")      # 0.5: it, son, mores of 6
    words("Write a haiku, please!")                      # ["write", "a", "haiku", "please"]

Tests: ``pytest tests/data/test_english.py``.
"""

from __future__ import annotations

import re

_LIST = """
a about above across act action active activity actually add address admit adult advice affect afraid after
again against age agency agent ago agree ahead air all allow almost alone along already also although always am
among amount an analysis and animal another answer any anyone anything appear apply approach area argue arm
around arrive art article artist as ask assume at attack attention audience author authority available avoid
away baby back bad bag ball bank bar base be beat beautiful because become bed before begin behavior behind
believe benefit best better between beyond big bill bit black blood blue board body book born both box boy
break bring brother budget build building business but buy by call camera campaign can cancer candidate capital
car card care career carry case catch cause cell center central century certain certainly chair challenge chance
change character charge check child choice choose church citizen city civil claim class clear clearly close
coach cold collection college color come commercial common community company compare computer concern condition
conference consider consumer contain continue control cost could country couple course court cover create crime
cultural culture cup current customer cut dark data daughter day dead deal death debate decade decide decision
deep defense degree democratic describe design despite detail determine develop development die difference
different difficult dinner direction director discover discuss discussion disease do doctor dog door down draw
dream drive drop drug during each early east easy eat economic economy edge education effect effort eight
either election else employee end energy enjoy enough enter entire environment environmental especially
establish even evening event ever every everybody everyone everything evidence exactly example executive exist
expect experience expert explain eye face fact factor fail fall family far fast father fear federal feel feeling
few field fight figure fill film final finally financial find fine finger finish fire firm first fish five
floor fly focus follow food foot for force foreign forget form former forward four free friend from front full
fund future game garden gas general generation get girl give glass go goal good government great green ground
group grow growth guess gun guy hair half hand hang happen happy hard have he head health hear heart heat heavy
help her here herself high him himself his history hit hold home hope hospital hot hotel hour house how however
huge human hundred husband i idea identify if image imagine impact important improve in include including
increase indeed indicate individual industry information inside instead institution interest interesting
international interview into investment involve issue it item its itself job join just keep key kid kill kind
kitchen know knowledge land language large last late later laugh law lawyer lay lead leader learn least leave
left leg legal less let letter level lie life light like likely line list listen little live local long look
lose loss lot love low machine magazine main maintain major majority make man manage management manager many
market marriage material matter may maybe me mean measure media medical meet meeting member memory mention
message method middle might military million mind minute miss mission model modern moment money month more
morning most mother mouth move movement movie mr mrs much music must my myself name nation national natural
nature near nearly necessary need network never new news newspaper next nice night nine no none nor north not
note nothing notice now number occur of off offer office officer official often oh oil ok okay old on once one
only onto open operation opportunity option or order organization other others our out outside over own owner
page pain painting paper parent part participant particular particularly partner party pass past patient pattern
pay peace people per perform performance perhaps period person personal phone physical pick picture piece place
plan plant play player pm point police policy political politics poor popular population position positive
possible power practice prepare present president pressure pretty prevent price private probably problem
process produce product production professional professor program project property protect prove provide public
pull purpose push put quality question quickly quite race radio raise range rate rather reach read ready real
reality realize really reason receive recent recently recognize record red reduce reflect region relate
relationship religious remain remember remove report represent republican require research resource respond
response responsibility rest result return reveal rich right rise risk road rock role room rule run safe same
save say scene school science scientist score sea season seat second section security see seek seem sell send
senior sense series serious serve service set seven several shake share she shoot short shot should shoulder
show side sign significant similar simple simply since sing single sister sit site situation six size skill skin
small smile so social society soldier some somebody someone something sometimes son song soon sort sound source
south southern space speak special specific speech spend sport spring staff stage stand standard star start
state statement station stay step still stock stop store story strategy street strong structure student study
stuff style subject success successful such suddenly suffer suggest summer support sure surface system table
take talk task tax teach teacher team technology television tell ten tend term test than thank that the their
them themselves then theory there these they thing think third this those though thought thousand threat three
through throughout throw thus time to today together tonight too top total tough toward town trade traditional
training travel treat treatment tree trial trip trouble true truth try turn tv two type under understand unit
until up upon us use usually value various very victim view violence visit voice vote wait walk wall want war
watch water way we weapon wear week weight well west western what whatever when where whether which while white
who whole whom whose why wide wife will win wind window wish with within without woman wonder word work worker
world worry would write writer wrong yard yeah year yes yet you young your yourself
able absolutely academic accept access accident according account accurate achieve acid active actor add
addition additional adjust advantage adventure affordable afternoon agenda aim alcohol algorithm alive allergy
alternative amazing american ancient angle angry announce annual anxiety apartment app apple application
appointment appreciate appropriate april architecture argument arrange arrangement array article artificial
aspect assignment assist assistance assistant assistants attempt attend attitude attract august automatic
average award aware awesome background bake balance banana band basic basis battery beach bean bear bedroom
beef beer beginner beginning behave belief belong below beside bike biology bird birthday blog bone bonus boost
boss bottle bottom brain brand bread breakfast brief bright brilliant broad broken brown browser bug buffer
busy button cake calculate calculation calendar calm campus cancel capacity captain carbon career careful carpet
cash cast castle cat category cause celebrate celebration chain chapter chart chat cheap cheese chemical
chemistry chicken chief chocolate cholesterol christmas circle class classic classroom clean click client
climate clock cloud club clue coast code coding coffee coin collect colleague column combine comfortable
command comment commit communicate communication comparison compete competition competitive complain complete
complex component concept conclusion concrete confidence confident confirm conflict confuse confusing connect
connection consistent constant construct construction consult contact content contest context contract
contribute convert cook cookie cool copy core corner correct count counter cousin cover craft crazy cream
creative credit crisis criteria critical cross crowd crucial cry curious currency curve custom cycle daily
damage dance danger dangerous database date dead deadline dear debt debug december declare decrease define
definition delete delicious deliver delivery demand demonstrate dentist depend deposit depression depth
desert desk dessert destination destroy develop developer device diabetes diagram dictionary diet digital
dinner direct dirty disagree disappear discount dish display distance distribute divide document dollar domain
double download dozen draft dress drink driver dry due dust duty eager ear earn earth ease easily edit editor
effective efficient egg elderly electric electricity element elephant email emergency emotion emotional empty
enable encourage engage engine engineer engineering english enhance ensure entertainment entry episode equal
equation equipment error escape essay essential estate estimate ethical europe evaluate evaluation exam
examine excellent except exchange excited exciting exercise expand expense expensive explore export express
expression extend extra extreme fabric facility fair faith fake false famous fan fantastic fashion fat
favorite feature february fee feed female fiction file filter finance fit fix flag flat flavor flight flow
flower folder font football forest forever format formula fortune forum frame framework frequency fresh friday
friendly fruit fuel fun function functional funny furniture gain gallery gap gate gear gender generate generous
genre gift global glad gold golf grade gradually graduate grammar grand grandmother graph grass grocery guide
guest guitar habit hall handle handsome happiness hardware harm hate healthy height hello helpful hero hey
hidden hide highlight highly hike hiking hill hire historical hobby holiday honest honey horse host hunt hurt
ice icon ideal identity ignore ill illegal illness image immediately import impossible impress impression
improvement incident income independent index indian inform initial injury innovation innovative input insect
insert install instance instruction instrument insurance integer integrate intelligence intelligent interact
interface internal internet introduce introduction invest investigate invite iron island java javascript
january journal journey joy judge juice july jump june junior kick king kiss knee knife lab label lack lady lake
lamp laptop latest layer lazy leaf league lean leather lecture lemon length lesson library license lift limit
link liquid literature loan location lock logic logo lonely loop lucky lunch luxury mac magic mail male mall
map march mark marketing master match math mathematics maximum meal meaning meanwhile meat medicine medium
melody mental menu mess metal middle midnight mild milk mine minimum minor mirror mistake mix mobile mode
moderate module monday monitor mood moon moral motion motivation motor mountain mouse multiple muscle museum
mystery narrative narrow native navigate negative neighbor neighborhood nervous neural newsletter noise normal
nose notebook novel november nurse nut nutrition object objective obvious ocean october odd offline online
opinion orange ordinary organic organize origin original outcome outline output overall overview pack package
paint pair palace panel paragraph parameter park parking passage passenger passion password patch path patient
peak pen pencil percent percentage perfect permission pet phase philosophy photo photograph photography phrase
physics piano pie pilot pink pipe pizza planet plastic plate platform pleasant please pleasure plenty plot plus
pocket poem poet poetry pool pop port portfolio portion pot potato pound powerful practical pray precise predict
prefer preference pregnant premium presentation preserve press previous pride primary prime prince print prior
priority prize procedure profile profit progress promise promote prompt proof proper proposal propose protein
proud psychology publish purchase pure purple puzzle python query quick quiet quit quiz quote rain random rank
rare raw react recipe recommend recommendation recover recovery rectangle reduction refer reference regular
reject relax release relevant reliable relief religion rely remote rent repair repeat replace reply request
rescue resolve respect restaurant restore retire revenue review revolution reward rhythm rice ride ring river
robot romantic roof root rough round route routine row royal rubber rude rural rush sad salad salary sale salt
sample sand sandwich saturday sauce scale schedule scheme screen script search secret sector select selection
self sensitive sentence separate september sequence server session setting settle sex shape sharp sheet shelf
shell shift shine ship shirt shock shoe shop shopping shower shut shy sick silent silly silver simulation sir
sky sleep slide slightly slow smart smell smoke snack snow soft software soil solar solid solution solve song
soup space spanish spare speaker speed spell spirit split spot spread square stable stack stadium stamp steady
steal steel stick stomach stone straight strange stranger stream strength stress stretch strict string strip
struggle studio stupid submit subscription substance suffer sugar suit suitable sum summary sun sunday super
supply surgery surprise surprised surround survey survive sustainable sweet swim switch symbol symptom syntax
tag tale talent tall tape target taste tea tear technical technique teen teenager telephone temperature
template temporary tennis tension terrible territory text texture theme therapy thick thin thirsty thursday
ticket tie tight tip tired title toe toilet tomato tomorrow tone tongue tool tooth topic touch tour tourist
towel tower toy track traffic train transfer transform transition translate translation transport trend
triangle trick trust tuesday tutorial twice twin typical ugly ultimate uncle unique universe university unknown
unless unusual update upgrade upset urban urgent user useful usual vacation valid valley van variable variety
vast vegetable vehicle version video village vintage virtual virus visible vision visual vital vocabulary
volume volunteer wage warm warn wash waste wave weak wealth weather website wedding wednesday weekend weird
welcome wheel wild wine winter wire wise witness wood wooden workout workshop worth wrap yellow yesterday yoga
zero zone
eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty
seventy eighty ninety billion fourth fifth sixth seventh eighth ninth tenth hundredth once twice
am is are was were been being has had having does did doing done made said went gone got gotten came seen saw
knew known took taken gave given told found thought brought bought felt kept left meant met paid ran sat sent
spent stood understood won wrote written began begun broke broken chose chosen drew drawn drove driven ate eaten
fell fallen flew flown forgot forgotten froze grew grown hid held hurt lay led lent lost rang rose risen sang
shook shot shut slept sold spoke spoken stole struck swam taught threw thrown wore worn woke
cannot can't won't don't doesn't didn't isn't aren't wasn't weren't haven't hasn't hadn't wouldn't shouldn't
couldn't i'm i've i'd i'll you're you've you'd you'll he's she's it's we're we've they're they've that's
there's what's let's who's here's
ai api cpu gpu html css sql json csv url pdf usb wifi ios android linux windows excel google amazon youtube
facebook twitter instagram iphone uk usa us eu covid crypto bitcoin blockchain machine learning dataset
neural chatbot llm github git docker cloud backend frontend react node rust golang kotlin swift typescript
regex recursion recursive iterate iteration sorting sorted binary boolean integer float tuple dictionary
pandas numpy matrix vector tensor compile compiler runtime exception debugging deploy deployment encryption
authentication
"""

COMMON_WORDS = frozenset(_LIST.split())
# regular endings, longest first, each with the stem endings that restore the list word ("" keeps the stem)
_ENDINGS = (
    ("n't", ("",)), ("'s", ("",)), ("'re", ("",)), ("'ve", ("",)), ("'ll", ("",)), ("'d", ("",)),
    ("ies", ("y",)), ("ied", ("y",)), ("ier", ("y",)), ("iest", ("y",)), ("ily", ("y",)),
    ("ing", ("", "e")), ("ed", ("", "e")), ("es", ("", "e")), ("er", ("", "e")), ("est", ("", "e")),
    ("ly", ("", "le")), ("s", ("",)), ("ment", ("",)), ("ness", ("",)), ("ful", ("",)), ("less", ("",)),
    ("able", ("", "e")), ("al", ("", "e")), ("ity", ("", "e")), ("ation", ("e", "")), ("ize", ("", "e")),
)  # fmt: skip
_PIECE_EDGES = "\"'`()[]{}<>.,;:!?*«»“”‘’"
_LETTERS = re.compile(r"[^\W\d_]")
_WORD = re.compile(r"[^\W\d_]+(?:['’-][^\W\d_]+)*")


def words(text: str) -> list[str]:
    """The pieces of ``text`` that hold a letter, lower-cased, punctuation around them dropped (whitespace splits
    pieces; a piece like ``ny3c__`` stays one piece)."""
    out = []
    for piece in text.split():
        piece = piece.strip(_PIECE_EDGES).lower().replace("’", "'")
        if _LETTERS.search(piece):
            out.append(piece)
    return out


def is_known(word: str) -> bool:
    """Whether a lower-case ``word`` (one of ``words``' pieces) is a list word, a list word with a regular ending,
    or a hyphenated or slashed pair of such words. A piece mixing letters with digits or underscores is not."""
    if word in COMMON_WORDS:
        return True
    for sep in ("-", "/"):
        if sep in word:
            parts = [p for p in word.split(sep) if p]
            return bool(parts) and all(is_known(p) for p in parts)
    if not _WORD.fullmatch(word):
        return False
    for ending, stems in _ENDINGS:
        if word.endswith(ending) and len(word) > len(ending) + 1:
            base = word[: -len(ending)]
            if any(base + stem in COMMON_WORDS for stem in stems):
                return True
            if len(base) > 2 and base[-1] == base[-2] and base[:-1] in COMMON_WORDS:  # "running", "stopped"
                return True
    return False


def known_share(text: str) -> float:
    """The share of ``text``'s words (``words``) that are known (``is_known``); 0.0 for a text without words."""
    found = words(text)
    return sum(map(is_known, found)) / len(found) if found else 0.0
