"""gradientflow-repro: an open reproduction of GradientFlow (Sun et al., arXiv 1902.06855).

The library: ``comm`` (the paper's techniques behind one interface), the trainer (``engine``) and its
parts, the scaling model (``perfmodel``) and the reproduction harness (``harness``); ``scripts/`` holds
thin command lines over it. Importing the package imports nothing heavy.
"""
