"""Numbers in user text that Python will not convert, or ranges too wide to build, answered by steerkit's
errors (what was expected, what was found, what to do) in every place user text becomes a number.

``int()`` refuses more than 4300 digits with a ``ValueError`` of its own ("Exceeds the limit (4300 digits)
for integer string conversion ... use sys.set_int_max_str_digits()"), and :func:`json.loads` raises it for a
whole number of 5,000 digits, outside its ``JSONDecodeError``. Regression tests for each place found: a
store ref ``ok@<5,000 digits>`` (the CLI), a pasted or uploaded prompt list of the app (found by
benchmarks/soak_app.py: "Unexpected error (ValueError)"), a prompts file of the CLI, the serving and record
specs, a saved patching result; and ``--hooks resid_post:0-999999999999`` / ``vectors tune --layers
0-999999999999``, which built a list of 10^12 layers (MemoryError) before any model could refuse them.
Mechanics only: no model is loaded.
"""
from __future__ import annotations

import json

import pytest

from steerkit.errors import InputError, SteerkitError
from steerkit.storage import jsontext

HUGE = "9" * 5000
PYTHONS_OWN = ("4300", "set_int_max_str_digits")


def assert_steerkit_message(e: BaseException, *expected: str) -> None:
    text = str(e)
    assert isinstance(e, SteerkitError), f"{type(e).__name__}: {text[:200]}"
    assert not any(p in text for p in PYTHONS_OWN[1:]), text[:300]
    assert len(text) < 600, f"the message echoes the whole input ({len(text)} characters)"
    for x in expected:
        assert x in text, text[:300]


def test_jsontext_reports_a_long_number_as_malformed_json_at_its_place():
    with pytest.raises(json.JSONDecodeError) as e:
        jsontext.loads('{"a": [1,\n  -' + HUGE + "]}")
    assert (e.value.lineno, e.value.colno) == (2, 3) and "5000 digits" in e.value.msg
    assert jsontext.loads('{"a": [1, -2.5, "3"]}') == {"a": [1, -2.5, "3"]}
    assert jsontext.loads(b"[" + b"9" * 4300 + b"]") == [int("9" * 4300)]  # up to Python's limit, as json.loads


def test_a_5000_digit_version_ref_is_the_stores_error_on_the_command_line(tmp_path, capsys):
    import torch

    from steerkit.cli import main
    from steerkit.vectors import SteeringVector, Store
    Store(tmp_path).save("ok", SteeringVector.from_direction(torch.ones(8), 1))
    for verb in (["show"], ["rm"], ["tag"]):
        argv = ["vectors", "--store", str(tmp_path), *verb, "ok@" + HUGE] + (["prod"] if verb == ["tag"] else [])
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("steerkit: error: expected the version") and "\n" not in err
        assert not any(p in err for p in PYTHONS_OWN)


@pytest.mark.parametrize("text", ["[" + HUGE + "]", '["a", ' + HUGE + "]", '{"prompt": ' + HUGE + "}"])
def test_the_apps_prompt_lists(text):
    from steerkit.apps.data import parse_prompt_text
    with pytest.raises(InputError) as e:
        parse_prompt_text(text, "list A")
    assert_steerkit_message(e.value, "list A", "5000 digits")


def test_the_clis_prompt_files(tmp_path):
    from steerkit.cli._common import read_prompts
    for name, text in (("p.json", '["a", ' + HUGE + "]"), ("p.jsonl", '{"prompt": "a"}\n{"prompt": ' + HUGE + "}")):
        (tmp_path / name).write_text(text)
        with pytest.raises(SteerkitError) as e:
            read_prompts(str(tmp_path / name))
        assert_steerkit_message(e.value, "5000 digits")


def test_the_serving_and_record_specs():
    from steerkit.serving.record_spec import parse_record
    from steerkit.serving.spec import SpecError, parse_spec
    with pytest.raises(SpecError) as e:
        parse_spec('{"artifacts": [{"ref": "happy@1", "scale": ' + HUGE + "}]}")
    assert_steerkit_message(e.value, "steering spec", "5000 digits")
    with pytest.raises(SpecError) as e:
        parse_spec('{"artifacts": [{"ref": "ok@' + HUGE + '"}]}')
    assert_steerkit_message(e.value, "ref")
    with pytest.raises(SpecError) as e:
        parse_record('{"hooks": ["blocks.1.hook_resid_post"], "positions": [' + HUGE + "], \"run\": \"r\"}")
    assert_steerkit_message(e.value, "record spec", "5000 digits")


def test_a_saved_patching_result():
    from steerkit.probes.patching import json_document
    with pytest.raises(InputError) as e:
        json_document('{"format": ' + HUGE + "}", "steerkit.patching/1", "a patching result")
    assert_steerkit_message(e.value, "5000 digits")


@pytest.mark.parametrize("spec", ["resid_post:0-999999999999", "resid_post:" + HUGE, "resid_post:0-" + HUGE,
                                  "resid_post:1+" + HUGE])
def test_hook_layers_of_the_cli(spec):
    from steerkit.cli._common import parse_hooks
    with pytest.raises(InputError) as e:
        parse_hooks(spec)
    assert_steerkit_message(e.value, "--hooks")
    assert parse_hooks("resid_post:2-4") == [("hook_resid_post", [2, 3, 4])]


@pytest.mark.parametrize("spec", ["0-999999999999", HUGE, "1,0-" + HUGE])
def test_layer_lists_of_the_cli(spec):
    from steerkit.hooks.names import parse_layers
    with pytest.raises(InputError) as e:
        parse_layers(spec, what="--layers")
    assert_steerkit_message(e.value, "--layers")
    assert parse_layers("6,10-12", what="--layers") == [6, 10, 11, 12]


def test_the_apps_layer_boxes_echo_a_bounded_part():
    from steerkit.apps.data import parse_layers
    with pytest.raises(InputError) as e:
        parse_layers("9" * 900, 30)
    assert_steerkit_message(e.value, "is not a layer index")
