"""The typed config: YAML recipes, dotted overrides, presets and one-line validation errors."""

from __future__ import annotations

import pytest

from vitrain.config import CONFIG_DIR, load_config, recipe_names, to_yaml
from vitrain.errors import ConfigError


def test_digits_recipe_loads_with_its_values():
    cfg = load_config(CONFIG_DIR / "digits.yaml")
    assert cfg.data.source == "digits"
    assert (cfg.model.width, cfg.model.depth, cfg.model.in_chans) == (128, 4, 1)


def test_every_shipped_recipe_is_valid():
    for name in recipe_names():
        load_config(CONFIG_DIR / f"{name}.yaml")


def test_overrides_are_typed_and_win_over_the_file():
    cfg = load_config(CONFIG_DIR / "digits.yaml", ["model.depth=6", "optim.lr=3e-3", "train.compile=true"])
    assert cfg.model.depth == 6
    assert cfg.optim.lr == pytest.approx(3e-3) and isinstance(cfg.optim.lr, float)
    assert cfg.train.compile is True


def test_list_override_for_tuple_fields():
    cfg = load_config(None, ["data.mean=[0.4,0.5,0.6]", "data.std=[0.2,0.2,0.2]"])
    assert cfg.data.mean == (0.4, 0.5, 0.6)


def test_preset_fills_architecture_and_explicit_fields_override_it():
    cfg = load_config(None, ["model.preset=ViT-B/16", "model.depth=6"])
    assert cfg.model.preset == "vit_base_patch16"
    assert (cfg.model.width, cfg.model.heads, cfg.model.mlp_dim, cfg.model.depth) == (768, 12, 3072, 6)


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown config key model\.dpeth; did you mean model\.depth\?"):
        load_config(None, ["model.dpeth=6"])


def test_unknown_section_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown config key optm; did you mean optim\?"):
        load_config(None, ["optm.lr=1"])


def test_wrong_type_names_field():
    with pytest.raises(ConfigError, match=r"model\.depth='six' must be an integer"):
        load_config(None, ["model.depth=six"])


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


def test_malformed_override():
    with pytest.raises(ConfigError, match=r"must look like section\.key=value"):
        load_config(None, ["model.depth"])


def test_yaml_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml must hold a mapping"):
        load_config(path)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  depth: [1, 2\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml line \d+ is not valid YAML"):
        load_config(path)


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(CONFIG_DIR / "cifar10.yaml", ["model.depth=3"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg
