"""The typed config: YAML recipes, dotted overrides, presets and one-line validation errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import vitrain
from tests.conftest import REPO
from vitrain import registry
from vitrain.cli import main
from vitrain.config import CONFIG_DIR, config_keys, load_config, recipe_names, resolve_config_path, to_yaml
from vitrain.errors import ConfigError


def test_digits_recipe_loads_with_its_values():
    cfg = load_config(CONFIG_DIR / "digits.yaml")
    assert cfg.data.source == "digits"
    assert (cfg.model.width, cfg.model.depth, cfg.model.in_chans) == (128, 4, 1)


def test_every_shipped_recipe_is_valid():
    for name in recipe_names():
        load_config(CONFIG_DIR / f"{name}.yaml")


def test_recipes_live_inside_the_package():
    assert CONFIG_DIR == Path(vitrain.__file__).resolve().parent / "configs"
    assert {"digits", "cifar10"} <= set(recipe_names())
    assert resolve_config_path("digits") == CONFIG_DIR / "digits.yaml"


def test_an_unknown_recipe_lists_the_shipped_ones_and_points_to_config_list():
    with pytest.raises(
        ConfigError,
        match=r"config file cifar100 not found; .*cifar10, cifar10-baseline, cifar10-fast, cifar10-shards, det.*`vitr",
    ):
        resolve_config_path("cifar100")


def test_the_wheel_ships_the_recipes(tmp_path):
    """A regular (non-editable) install gets the recipes only if the wheel carries them as package data."""
    try:
        import setuptools  # noqa: F401
    except ImportError:
        pytest.skip("setuptools is not installed, so the wheel cannot be built without build isolation")
    source = tmp_path / "source"  # a copy, so the build leaves no build/ or egg-info in the checkout
    shutil.copytree(REPO / "vitrain", source / "vitrain", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q"]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run([*command, "-w", str(tmp_path / "wheel")], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "wheel").glob("vitrain-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"vitrain/configs/digits.yaml", "vitrain/configs/cifar10.yaml"} <= names


def test_overrides_are_typed_and_win_over_the_file():
    cfg = load_config(CONFIG_DIR / "digits.yaml", ["model.depth=6", "optim.lr=3e-3", "train.compile=true"])
    assert cfg.model.depth == 6
    assert cfg.optim.lr == pytest.approx(3e-3) and isinstance(cfg.optim.lr, float)
    assert cfg.train.compile is True


def test_one_flatten_serves_the_config_and_the_trust_check_of_a_read_config():
    # vitrain.config.flatten and the trust check's flattening of a meta.json were twins; one is kept, both import paths.
    from vitrain import config, trust

    assert config.flatten is trust.flatten
    assert config.flatten({"model": {"width": 192, "stem": [1, 2]}, "name": "x"}) == {
        "model.width": 192,
        "model.stem": [1, 2],
        "name": "x",
    }
    assert config.flatten(["a meta.json holding a list"]) == {}  # no keys, as the trust check reads it


def test_list_override_for_tuple_fields():
    cfg = load_config(None, ["data.mean=[0.4,0.5,0.6]", "data.std=[0.2,0.2,0.2]"])
    assert cfg.data.mean == (0.4, 0.5, 0.6)


def test_preset_fills_architecture_and_explicit_fields_override_it():
    cfg = load_config(None, ["model.preset=ViT-B/16", "model.depth=6"])
    assert cfg.model.preset == "vit_base_patch16"
    assert (cfg.model.width, cfg.model.heads, cfg.model.mlp_dim, cfg.model.depth) == (768, 12, 3072, 6)


def test_a_preset_on_the_command_line_replaces_the_recipes_architecture(tmp_path):
    recipe = tmp_path / "small.yaml"
    recipe.write_text(
        "model:\n  image_size: 16\n  patch_size: 4\n  width: 128\n  depth: 4\n  heads: 4\n  in_chans: 1\n"
    )
    cfg = load_config(recipe, ["model.preset=vit_small_patch16"]).model
    assert (cfg.image_size, cfg.patch_size, cfg.width, cfg.depth, cfg.heads) == (224, 16, 384, 12, 6)
    assert cfg.in_chans == 1  # not part of a preset: the recipe's
    cfg = load_config(recipe, ["model.preset=vit_small_patch16", "model.image_size=64"]).model
    assert (cfg.image_size, cfg.width) == (64, 384)
    # A preset in the recipe itself is filled in under the recipe's own fields, as before.
    recipe.write_text("model:\n  preset: vit_small_patch16\n  image_size: 32\n")
    assert load_config(recipe, []).model.image_size == 32


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown config key model\.dpeth; did you mean model\.depth\?"):
        load_config(None, ["model.dpeth=6"])


def test_unknown_section_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown config key optm; did you mean optim\?"):
        load_config(None, ["optm.lr=1"])


def test_wrong_type_names_field():
    with pytest.raises(ConfigError, match=r"model\.depth='six' must be an integer"):
        load_config(None, ["model.depth=six"])


def test_a_switch_of_true_false_or_auto_takes_each_and_refuses_others_in_one_line():
    for given, expected in (("true", True), ("off", False), ("auto", "auto")):
        cfg = load_config(overrides=[f"precision.compile_norms={given}"], check=False)  # true: a compiler or not
        assert cfg.precision.compile_norms == expected
    with pytest.raises(
        ConfigError, match=r"precision\.compile_norms='maybe' is not allowed; choose one of: true, false, auto"
    ):
        load_config(overrides=["precision.compile_norms=maybe"])


def test_bad_choice_lists_alternatives():
    with pytest.raises(ConfigError, match=r"model\.pool=mean is not allowed"):
        load_config(None, ["model.pool=mean"])


def test_width_not_divisible_by_heads():
    with pytest.raises(ConfigError, match=r"model\.width=390 is not divisible by model\.heads=4"):
        load_config(None, ["model.width=390", "model.heads=4"])


def test_patch_must_divide_image():
    with pytest.raises(ConfigError, match=r"model\.patch_size=5 does not divide model\.image_size=32"):
        load_config(None, ["model.image_size=32", "model.patch_size=5"])


def test_width_not_multiple_of_8_warns():
    with pytest.warns(UserWarning, match="not a multiple of 8"):
        load_config(None, ["model.width=36", "model.heads=6"])


def test_unknown_preset_suggests():
    with pytest.raises(ConfigError, match=r"did you mean vit_base_patch16\?"):
        load_config(None, ["model.preset=vit_base_patch61"])
    with pytest.raises(ConfigError, match=r"model.preset=0 is not a known preset"):  # it was ignored
        load_config(None, ["model.preset=0"])


def test_malformed_override():
    with pytest.raises(ConfigError, match=r"must look like section\.key=value"):
        load_config(None, ["model.depth"])
    with pytest.raises(ConfigError, match=r"\[0\.5 is not a whole YAML list or mapping; close it with '\]'"):
        load_config(None, ["data.mean=[0.5"])  # it was read as the text "[0.5", then as [0.5]
    assert load_config(None, ["name=a: b: c"]).name == "a: b: c"  # text YAML cannot read stays text
    shards = "data.root={a,b}/shard-{000..009}.tar"  # closed braces YAML cannot read: a brace pattern, as before
    assert load_config(None, [shards], check=False).data.root == "{a,b}/shard-{000..009}.tar"


@pytest.mark.parametrize(
    ("name", "content", "pattern"),
    [
        ("bad.yaml", b"- just\n- a list\n", r"bad\.yaml must hold a mapping"),
        ("broken.yaml", b"model:\n  depth: [1, 2\n", r"broken\.yaml line \d+ is not valid YAML"),
        ("random.yaml", bytes(range(128, 256)) * 2, r"random\.yaml is not a YAML file \(not UTF-8 text\)"),
        (
            "control.yaml",
            b"optim:\n  lr: 1\x00\x01\n",
            r"control\.yaml is not a YAML file \(special characters are not allowed\)",
        ),
        (
            "twice.yaml",
            b"optim:\n  lr: 0.1\n  lr: 0.2\n",
            r"twice\.yaml line 3 is not valid YAML: key lr is given twice \(lines 2 and 3\); keep one",
        ),
        (
            "twice.yaml",
            b"optim:\n  lr: 0.1\ntrain:\n  epochs: 2\noptim:\n  eps: 1.0e-6\n",
            r"key optim is given twice \(lines 1 and 5\)",
        ),
    ],
    ids=["a-list", "bad-syntax", "binary", "control-characters", "key-twice", "section-twice"],
)
def test_a_config_file_that_is_not_a_yaml_mapping_is_refused_naming_file_and_why(tmp_path, name, content, pattern):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=pattern):
        load_config(path)


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(CONFIG_DIR / "cifar10.yaml", ["model.depth=3"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


# ---------------------------------------------------------------------------------------------- bad values (fix/config)

# Each float key with how many values it takes (a list key: its default's length, at least one).
FLOAT_KEYS = {
    k.key: max(1, len(json.loads(k.default))) if k.type.startswith("list") else 0
    for k in config_keys()
    if k.type in ("float", "float | null", "list of float")
}


def test_the_float_keys_are_found():
    assert {"optim.lr", "optim.head_weight_decay", "data.mean", "train.time_limit_s", "run.watchdog_min_s"} <= set(
        FLOAT_KEYS
    )


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_key_refuses_nan_and_inf_naming_key_and_value(key, value):
    given = f"[{','.join([value] * FLOAT_KEYS[key])}]" if FLOAT_KEYS[key] else value
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}={value} must be a finite number"):
        load_config(overrides=[f"{key}={given}"], check=False)


def test_a_number_too_large_for_a_float_is_refused_as_infinite():
    with pytest.raises(ConfigError, match=r"^optim\.lr=1e400 must be a finite number \(it reads as inf\)"):
        load_config(overrides=["optim.lr=1e400"])


@pytest.mark.parametrize("text, shown", [(".nan", "nan"), (".inf", "inf"), ("-.inf", "-inf")])
def test_a_yaml_file_with_nan_or_inf_is_refused_naming_the_key(tmp_path, text, shown):
    path = tmp_path / "recipe.yaml"
    path.write_text(f"optim:\n  lr: {text}\n")
    with pytest.raises(ConfigError, match=rf"^optim\.lr={shown} must be a finite number"):
        load_config(path)


def test_a_nan_override_stops_train_before_the_run_folder_exists(tmp_path, capsys):
    argv = ["train", "digits", "schedule.warmup_epochs=nan", f"log.out_dir={tmp_path / 'runs'}", "name=x"]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        "vitrain: error: schedule.warmup_epochs=nan must be a finite number; nan and inf are not allowed"
    ]
    assert not (tmp_path / "runs").exists()


def test_a_config_path_that_is_a_directory_is_one_line_naming_it(tmp_path, capsys):
    (tmp_path / "cfg").mkdir()
    assert main(["config", "show", str(tmp_path / "cfg")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"vitrain: error: config file {tmp_path / 'cfg'} is a directory, not a YAML file; give a .yaml file or a "
        "recipe name"
    ]


def test_estimate_with_a_directory_as_its_config_is_one_line(tmp_path, capsys):
    assert main(["estimate", "vit_tiny_patch16", "--config", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"vitrain: error: config file {tmp_path} is a directory, not a YAML file; give a .yaml file or a recipe name"
    ]


def test_a_yaml_merge_key_may_still_be_overridden_beside_it(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("model:\n  <<: {depth: 3, width: 64, heads: 2}\n  depth: 4\n")
    cfg = load_config(path).model
    assert (cfg.depth, cfg.width, cfg.heads) == (4, 64, 2)


@pytest.mark.parametrize(
    "text, override, where",
    [
        ("train: 5\n", "train.max_steps=1", "train must be a mapping of keys, got 5"),
        ("train:\n  distill: yes\n", "train.distill.teacher=x", "train.distill must be a mapping of keys, got True"),
    ],
)
def test_a_section_of_the_wrong_type_is_refused_when_an_override_sets_a_key_in_it(tmp_path, text, override, where):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(where)):  # it was replaced by the override, silently
        load_config(path, [override])


def test_an_empty_config_file_means_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing set yet\n")
    assert load_config(path) == load_config()


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.threads=-1", "train.threads=-1 must be >= 0 (0: torch's default)"),
        ("train.max_steps=-1", "train.max_steps=-1 must be >= 0 (0: no limit)"),
        ("train.checkpoint_every_steps=-1", "train.checkpoint_every_steps=-1 must be >= 0 (0: at the end of each"),
        ("train.seed=-1", "train.seed=-1 must be >= 0"),
        ("data.crop_padding=-1", "data.crop_padding=-1 must be >= 0"),
        ("data.decode_workers=-1", "data.decode_workers=-1 must be >= 0"),
        ("data.shuffle_buffer=-1", "data.shuffle_buffer=-1 must be >= 0"),
        ("data.synthetic_samples=0", "data.synthetic_samples=0 must be positive"),
    ],
)
def test_a_negative_count_or_interval_is_refused_naming_it(override, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        load_config(overrides=[override])


@pytest.mark.parametrize("key", ["train.threads", "train.max_steps", "train.checkpoint_every_steps", "train.seed"])
def test_zero_keeps_its_documented_meaning(key):
    assert load_config(overrides=[f"{key}=0"]).train == load_config().train


def test_face_needs_two_verification_identities():
    with pytest.raises(ConfigError, match=r"^task\.verify_identities=1 must be >= 2"):
        load_config(CONFIG_DIR / "face.yaml", ["task.verify_identities=1"])


def test_bench_optim_refuses_negative_threads_in_one_line(capsys):
    assert main(["bench", "optim", "--threads", "-1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "vitrain: error: vitrain bench optim: argument --threads: -1 must be an integer >= 0 (see vitrain bench optim "
        "--help)"
    ]


def test_an_engine_path_to_a_function_is_refused_saying_an_engine_class_is_expected():
    with pytest.raises(
        ConfigError,
        match=r"^train\.engine=os:system is a function, not an engine class with the methods of the Engine protocol "
        r"\(vitrain\.engine\.protocol\)$",
    ):
        load_config(overrides=["train.engine=os:system"])


def test_an_engine_class_without_the_protocols_methods_is_refused_naming_them():
    with pytest.raises(ConfigError, match=r"^train\.engine=collections:OrderedDict is a class without autocast, "):
        load_config(overrides=["train.engine=collections:OrderedDict"])


@pytest.mark.parametrize(
    "override, line",
    [
        ("task.name=os:system", r"^task\.name=os:system is a function, not a task class with the methods"),
        ("model.name=os:sep", r"^model\.name=os:sep is a str, not a model factory"),
        ("data.source=os:path", r"^data\.source=os:path is a module, not a data source"),
    ],
)
def test_a_plug_in_path_to_the_wrong_kind_of_thing_is_refused_saying_what_was_expected(override, line):
    with pytest.raises(ConfigError, match=line):
        load_config(overrides=[override])


def test_a_registered_component_of_the_wrong_kind_is_refused_when_named():
    registry.register("engine", "not-an-engine", print)
    try:
        with pytest.raises(ConfigError, match=r"^train\.engine=not-an-engine is a function, not an engine class"):
            load_config(overrides=["train.engine=not-an-engine"])
    finally:
        del registry._REGISTERED["engine"]["not-an-engine"]


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ("model", registry.lookup),
            r"^register\('model', lookup\) gives no name; call register\(kind, name, obj\) or ",
        ),
        (("models", "mine", print), r"^register: kind 'models' is not one of model, task, engine, data; call register"),
        (("x", "model", print), r"^register: kind 'x' is not one of model, task, engine, data; "),
        (("model", None, print), r"^register\('model', None, \.\.\.\): the name must be a non-empty string"),
        (("model", "", print), r"^register\('model', '', \.\.\.\): the name must be a non-empty string"),
    ],
)
def test_register_refuses_a_missing_name_and_an_unknown_kind_in_one_line(args, line):
    before = {kind: dict(found) for kind, found in registry._REGISTERED.items()}
    with pytest.raises(ConfigError, match=line):
        vitrain.register(*args)
    assert registry._REGISTERED == before


def test_components_of_the_right_kind_by_import_path_are_accepted():
    cfg = load_config(
        overrides=[
            "train.engine=vitrain.engine.native:NativeEngine",
            "task.name=tests.test_bring_your_own:ErrorRateTask",
            "model.name=tests.test_bring_your_own:user_net",
            "data.source=vitrain.data.sources:digits_source",
        ]
    )
    assert cfg.train.engine == "vitrain.engine.native:NativeEngine"


def test_a_wrong_engine_kind_stops_train_in_one_line_before_the_run_folder_exists(tmp_path, capsys):
    argv = ["train", "digits", "train.engine=os:system", f"log.out_dir={tmp_path / 'runs'}", "name=x"]
    assert main(argv) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.eps=-1e-8", "optim.eps=-1e-08 must be >= 0"),
        ("optim.trust_coefficient=-0.001", "optim.trust_coefficient=-0.001 must be >= 0"),
        ("schedule.gamma=-0.1", "schedule.gamma=-0.1 must be >= 0 (it multiplies the lr)"),
        ("schedule.cycle_decay=-0.5", "schedule.cycle_decay=-0.5 must be >= 0 (it multiplies the lr)"),
    ],
)
def test_a_negative_optimizer_or_schedule_factor_is_refused_naming_it(override, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        load_config(overrides=[override])


@pytest.mark.parametrize("betas", ["[1.5,0.9]", "[0.9,1.0]", "[-0.1,0.999]"])
@pytest.mark.parametrize("name", ["adamw", "lamb", "muon"])
def test_betas_outside_0_to_1_are_refused_naming_them(betas, name):
    with pytest.raises(ConfigError, match=r"^optim\.betas=\[.*\]: each beta must be in \[0, 1\)"):
        load_config(overrides=[f"optim.betas={betas}", f"optim.name={name}"])
