"""The tests' child processes: forked from one server per pytest worker that imported torch,
megatron-core and our test support once.

A spawned child imports them again, seconds each on the 2-core CI box, and a run starts well
over a hundred children (gloo ranks, receivers, publishers). A child here is a fork of the
server: the imports are done, nothing else is shared (the server has run no torch op, made no
thread or gRPC channel). As with spawn, the child gets the parent's environment and
working directory as they are at ``start()``, and its target and arguments are pickled
(module-level functions). Where CUDA is, children are spawned as before: importing
megatron-core initializes CUDA in the server, and a forked child cannot use it then.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.multiprocessing as mp

PRELOAD = ["torch", "megatron.core", "tests.support.megatron", "tests.support.processes"]
"""Imported once by the server (one missing from the environment is skipped: the SGLang venv
has no megatron-core)."""


@functools.cache
def _method() -> str:
    return "spawn" if torch.cuda.is_available() else "forkserver"


@functools.cache
def context():
    """The forkserver context (its server starts with the first child); spawn's with CUDA."""
    ctx = mp.get_context(_method())
    if _method() == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _run(env: dict[str, str], cwd: str, target, args: tuple, kwargs: dict):
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    return target(*args, **kwargs)


def process(target, args: tuple = (), kwargs: dict | None = None, **options):
    """An unstarted child running ``target(*args, **kwargs)`` (``options``: ``daemon``...)."""
    return context().Process(
        target=_run, args=(dict(os.environ), os.getcwd(), target, args, kwargs or {}), **options
    )


def queue():
    return context().Queue()


def event():
    return context().Event()


def _rank(index: int, env: dict[str, str], cwd: str, fn, args: tuple) -> None:
    _run(env, cwd, fn, (index, *args), {})


def start_ranks(fn, args: tuple, nprocs: int) -> None:
    """``fn(i, *args)`` in ``nprocs`` children, as ``torch.multiprocessing.spawn`` (raises
    when one fails, after all ended)."""
    context()  # the preload is set before torch starts the server
    mp.start_processes(
        _rank, args=(dict(os.environ), os.getcwd(), fn, args), nprocs=nprocs,
        start_method=_method(),
    )  # fmt: skip
