"""One vocabulary: the position names are defined once (``steerkit.hooks.positions.POSITION_NAMES``) and the
layer lists users type are read by one parser (``steerkit.hooks.names.parse_layers``), which the command line,
the vLLM request spec and the app's layer boxes all call; the old names of those lists still work and warn."""
from __future__ import annotations

import warnings

import pytest

from steerkit.errors import InputError
from steerkit.hooks.names import parse_layers
from steerkit.hooks.positions import POSITION_NAMES, plain_positions, positions_from_text, validate_positions


def test_layer_lists_have_ranges_all_and_bounds():
    assert parse_layers("6,10-14") == [6, 10, 11, 12, 13, 14]
    assert parse_layers(" 3 , 1-2 ,3") == [1, 2, 3]  # sorted, each layer once
    assert parse_layers("all", 4) == [0, 1, 2, 3] and parse_layers("ALL") == "all"
    assert parse_layers([2, 0, 2], 3) == [0, 2] and parse_layers(1, 3) == [1] and parse_layers(range(2), 2) == [0, 1]
    cases = {"": "at least one layer", "x": "'x' is not a layer index", "07": "'07' is not a layer index",
             "-1": ">= 0", "5-3": "A <= B", "0-99999": "below 30", "1,2-40": "below 30",
             "30": "below 30 (the model's 30 layers are 0-29), found 30; choose among them"}
    for text, msg in cases.items():
        with pytest.raises(InputError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            parse_layers(text, 30)
    with pytest.raises(InputError, match="at most 4096 layers"):
        parse_layers("0-99999")  # refused before the range is built
    with pytest.raises(InputError, match="a list of layer indices"):
        parse_layers([1.5], 30)
    with pytest.raises(InputError, match="expected --layers"):
        parse_layers("a", what="--layers")


def test_the_cli_the_server_and_the_app_read_layers_with_the_one_parser():
    from steerkit.apps.data import parse_layers as app_layers
    from steerkit.cli._common import parse_hooks, resolve_hooks
    from steerkit.cli.methods import _layers
    from steerkit.serving.spec import SpecError, parse_spec

    want = [1, 3, 4, 5]
    assert parse_hooks("resid_post:1+3-5") == [("hook_resid_post", want)]  # ranges inside --hooks too
    assert resolve_hooks(parse_hooks("mlp_out:all"), 2) == ["blocks.0.hook_mlp_out", "blocks.1.hook_mlp_out"]
    assert _layers("1,3-5") == tuple(want) and _layers("all", 3) == (0, 1, 2) and _layers(None) is None
    assert app_layers("5,3-4,1", 30) == want
    op = parse_spec({"ops": [{"op": "add", "layers": "1,3-5", "vector": [1.0]}]}).ops[0]
    assert op.layers == tuple(want)
    assert parse_spec({"ops": [{"op": "add", "layers": want, "vector": [1.0]}]}).canonical() == \
        parse_spec({"ops": [{"op": "add", "layers": "1,3-5", "vector": [1.0]}]}).canonical()
    for bad, msg in (("all", "name its layers"), ("2-1", "A <= B")):
        with pytest.raises(SpecError, match=msg):
            parse_spec({"ops": [{"op": "add", "layers": bad, "vector": [1.0]}]})
    with pytest.raises(InputError, match="below 2"):
        resolve_hooks(parse_hooks("resid_post:0-5"), 2)


def test_one_list_of_position_names_everywhere():
    from steerkit.serving.record_spec import parse_record
    from steerkit.serving.spec import SpecError, parse_spec

    assert POSITION_NAMES == ("all", "prompt", "generated", "last")
    for name in POSITION_NAMES:
        assert validate_positions(name) == name == plain_positions(name) == positions_from_text(name)
        assert parse_spec({"ops": [{"op": "add", "layers": [0], "vector": [1.0], "positions": name}]}).ops[0].positions \
            == name
        assert parse_record({"hooks": ["blocks.0.hook_resid_post"], "positions": name, "run": "r"}).positions == name
    assert positions_from_text("0, -1") == [0, -1] and plain_positions((2,)) == [2]
    for bad in ("first", [], [True], [0.5], 3):
        with pytest.raises(InputError):
            plain_positions(bad)
        with pytest.raises(SpecError):
            parse_spec({"ops": [{"op": "add", "layers": [0], "vector": [1.0], "positions": bad}]})
    with pytest.raises(InputError, match="--positions"):
        positions_from_text("0,x", "--positions")


def test_the_old_names_of_the_position_list_warn():
    import steerkit.serving.spec as spec
    import steerkit.vectors.artifacts as artifacts
    from steerkit.vectors.artifacts import latent

    for module, old in ((spec, "NAMED_POSITIONS"), (latent, "CLAMP_POSITIONS"), (artifacts, "CLAMP_POSITIONS")):
        with pytest.warns(DeprecationWarning, match="steerkit.hooks.positions.POSITION_NAMES"):
            assert getattr(module, old) is POSITION_NAMES
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError):
            spec.NO_SUCH_NAME  # noqa: B018
