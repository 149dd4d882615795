"""The CPU demos' assets, written locally with no download: ``python -m mrl.quickstarts <demo>``.

Each demo module writes a tiny model and its data from a seed (two runs write identical bytes) and
registers a :class:`mrl.quickstarts.cli.Demo`; ``mrl/quickstarts/cli.py`` is the one command line
they share (``--out``, ``--seed``, ``--force`` and each demo's own flags). The configs that train on
them are ``mrl_configs/quickstart*.yaml``; ``make train CONFIG=...`` writes the assets first.
"""
