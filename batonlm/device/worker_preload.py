"""What a device worker imports before it loads a model, imported once by the fork server when
workers start by `forkserver` (`batonlm.spawn.worker_process`); its forked workers start with it
imported. Nothing here may start a thread or touch a device: a fork copies neither."""

import torch  # noqa: F401

import batonlm.device.cpu_worker  # noqa: F401
import batonlm.device.factory  # noqa: F401
import batonlm.device.tp_ranks  # noqa: F401
