"""Targets: each lowers IR expressions to its language and renders its templates into a module.

A target is one module here (a Backend: name, file name, dialect, templates) plus its folder
under templates/. attngen.build knows targets only through TARGETS.
"""

from attngen.backends.pallas_tpu import PALLAS_TPU
from attngen.backends.triton_gpu import TRITON_GPU

TARGETS = (TRITON_GPU, PALLAS_TPU)
