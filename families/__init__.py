"""
Families of decoder layers beside model.py's dense GLM-4 one, each a chapter of its own that registers itself in
model.FAMILIES on import (model.py never imports this package; machinery/__init__.py does, so every run, bench
and test that uses the machinery has them): mla_moe.py, GLM-4.7-Flash's and GLM-5's Multi-head Latent Attention
and Mixture of Experts, with routing replay's record. mtp.py, the multi-token-prediction layers of every family
(model.MTP), is imported here with the package, so whatever imports a family has it.
"""
from families import mtp  # noqa: F401 (it sets model.MTP: GLM builds, loads and saves MTP layers through it)
