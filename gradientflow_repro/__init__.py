"""gradientflow-repro: an open reproduction of GradientFlow (Sun et al., arXiv 1902.06855).

The library: the trainer (``train``, ``engine``) and its parts, ``comm`` (the paper's techniques
behind one interface), ``data``, ``models``, ``config``. The tooling around it, by role (the
library never imports it): ``reproduction`` (``make reproduce``), ``cluster`` (the emulated
network and launching ranks), ``bench`` (``make bench``), ``scaling`` (the scaling model and its
measurements) and ``gpu_check`` (``make gpu-check``). ``scripts/`` holds thin command lines over
them. The package runs from a checkout (its configurations are ``configs/`` beside it).
Importing the package imports nothing heavy.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the checkout: configs/, results/ (an editable install)
