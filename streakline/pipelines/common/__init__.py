"""What several stages need, below the stages: no stage module imports another, they all import from here.

| module | holds |
|---|---|
| ``roles.py`` | the device, each role's tokenizer, the block-diffusion target, tokenizer bridging |
| ``prompts.py`` | prompt text from the command line, benchmark records, their token ids |
| ``lookup.py`` | where each stage's artifact lives (its run key) and how later stages find it |
| ``kinds/`` | the drafter kinds (``DRAFTER_KINDS``): how each is told apart, built, trained, decoded, exported |
"""
