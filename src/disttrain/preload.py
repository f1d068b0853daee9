"""Modules the built-in job's workers need, imported once in a warm fork server.

`disttrain run` starts multiprocessing's fork server at the very beginning, with this
module as its preload, so the server imports torch and torch._dynamo (DDP and every
optimizer import it on first use: ~1.1 s here) on one core while the launcher imports
torch on the other. torchrun's agent then starts the workers with start_method
"forkserver": each worker is a fork of the warm server and starts training at once.
The server never touches CUDA, so its forks may use GPUs.
"""

import torch
import torch._dynamo
import torch.distributed
import torch.nn.parallel  # noqa: F401

import disttrain.builder
import disttrain.worker  # noqa: F401
