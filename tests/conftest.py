"""Pytest fixtures and hooks only; the helpers the test modules share are in ``helpers/``."""

from __future__ import annotations

import os

import pytest
import torch

from helpers.models import tiny_model


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (two threads thrash on a busy 2-core machine); an explicit
    ``OMP_NUM_THREADS`` wins, so a run can check that results hold with another thread split of the kernels."""
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    yield
    torch.set_num_threads(before)


@pytest.fixture
def llama():
    return tiny_model("llama")
