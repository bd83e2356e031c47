"""Devices and dtypes: ``load_model(device="auto", dtype="auto")`` and the one model option group
(``--model --device --dtype``) on every command-line verb that loads a model."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

import steerkit
from steerkit.cli import build_parser
from steerkit.errors import InputError
from steerkit.loading.device import pick_device, pick_dtype


#: verbs that load a model but are not the shared group's: ``model export`` writes from the CPU and casts with
#: its own ``--dtype`` (the written type), ``serve`` hands the model to vLLM
OWN_OPTIONS = {("model", "export"), ("serve",)}


def _verbs(parser: argparse.ArgumentParser, path: tuple = ()):
    """``(path, parser)`` of every leaf verb."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, sp in subs[0].choices.items():
        yield from _verbs(sp, path + (name,))


def test_every_verb_that_loads_a_model_has_device_and_dtype():
    verbs = dict(_verbs(build_parser()))
    loading = {p: sp for p, sp in verbs.items() if "--model" in sp._option_string_actions}
    assert {("info",), ("record",), ("demo",), ("refusal",), ("app",), ("vectors", "tune"), ("probe", "fit"),
            ("temporal",), ("caa",)} <= set(loading), sorted(loading)
    for path, sp in loading.items():
        if path in OWN_OPTIONS:
            continue
        opts = sp._option_string_actions
        assert "--device" in opts and "--dtype" in opts, path
        assert opts["--device"].default == "auto" and opts["--dtype"].default == "auto", path
        assert set(opts["--dtype"].choices) == {"auto", "float32", "bfloat16", "float16"}, path


def test_auto_picks_the_cpu_and_float32_here():
    assert not torch.cuda.is_available()  # this suite's machine; on a GPU machine auto picks cuda / bfloat16
    assert pick_device("auto") == torch.device("cpu") and pick_dtype("auto", "cpu") == torch.float32
    assert pick_dtype("auto", "auto") == torch.float32 and pick_dtype("float16") == torch.float16
    with pytest.raises(InputError, match=r"expected a CUDA device for device='cuda:1', found none .* use device='cpu'"):
        pick_device("cuda:1")
    with pytest.raises(InputError, match="expected a floating-point torch dtype"):
        pick_dtype(torch.int8)


def test_auto_on_a_cuda_machine_picks_bfloat16_where_supported(monkeypatch):
    """What ``auto`` does on a GPU, with torch's CUDA queries answered as a GPU machine answers them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert pick_device("auto") == torch.device("cuda") and pick_dtype("auto", "auto") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # before compute capability 8.0
    assert pick_dtype("auto", "cuda") == torch.float32


@pytest.fixture(scope="module")
def tiny_folder(make_tiny_folder):
    return make_tiny_folder()


def test_load_model_takes_device_and_dtype(tiny_folder):
    sm = steerkit.load_model(tiny_folder)
    assert sm.device == torch.device("cpu") and sm.dtype == torch.float32
    bf = steerkit.load_model(tiny_folder, device="cpu", dtype="bfloat16")
    assert bf.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in bf.hf_model.parameters())
    with pytest.raises(InputError, match="expected a torch device"):
        steerkit.load_model(tiny_folder, device="gpu")


def test_the_cli_loads_on_the_device_and_dtype_it_is_given(tiny_folder):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, "-m", "steerkit", "info", "--model", str(tiny_folder), "--device", "cpu",
                        "--dtype", "bfloat16", "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["dtype"] == "torch.bfloat16" and info["device"] == "cpu"


def test_the_app_loads_every_model_with_its_options(tiny_folder):
    from steerkit.apps.runtime import ModelHost

    host = ModelHost(str(tiny_folder), load_options=dict(device="cpu", dtype="bfloat16"))
    assert host.get().dtype == torch.bfloat16
    assert host.switch(str(tiny_folder)).dtype == torch.bfloat16
