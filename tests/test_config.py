"""The recipe schema: defaults, validation messages, overrides, hashing, recipe lookup."""

import math

import pytest
import yaml

from megatron_core import config
from megatron_core.config import Recipe, load_recipe, recipe_from_dict
from megatron_core.errors import UserError


def minimal(**sections):
    return {"name": "t", "version": 1, **sections}


def test_defaults_are_megatron_defaults():
    r = recipe_from_dict(minimal())
    t, m = r.training, r.model
    assert (t.seed, t.adam_beta1, t.adam_beta2, t.adam_eps, t.clip_grad, t.weight_decay) == (
        1234,
        0.9,
        0.999,
        1e-8,
        1.0,
        0.01,
    )
    assert (t.initial_loss_scale, t.min_loss_scale, t.loss_scale_window, t.hysteresis) == (2.0**32, 1.0, 1000, 2)
    assert (m.hidden_dropout, m.attention_dropout, m.init_method_std, m.layernorm_epsilon) == (0.1, 0.1, 0.02, 1e-5)
    assert m.make_vocab_size_divisible_by == 128 and t.lr_decay_style == "linear"
    assert r.data.split == "969,30,1"


def test_codeparrot_small_is_the_public_run():
    r = load_recipe("codeparrot-small-8gpu")
    m, p, t, d = r.model, r.parallel, r.training, r.data
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.max_position_embeddings) == (
        12,
        768,
        12,
        1024,
        1024,
    )
    assert (p.world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (8, 1, 1)
    assert (t.micro_batch_size, t.global_batch_size, t.train_iters, t.lr, t.lr_decay_style) == (
        12,
        192,
        150000,
        5e-4,
        "cosine",
    )
    assert (t.lr_warmup_iters, t.lr_decay_iters, t.weight_decay, t.adam_beta2, t.fp16) == (
        2000,
        150000,
        0.1,
        0.999,
        True,
    )
    assert (t.log_interval, t.save_interval, t.eval_interval, t.eval_iters) == (10, 2000, 200, 10)
    assert d.split == "969,30,1" and d.json_keys == ["content"] and d.append_eod
    assert r.corpus.sources[0].name == "codeparrot/codeparrot-clean-train"
    assert r.padded_vocab_size(32768) == 32768 and r.padded_vocab_size(50257) == 50304
    assert r.num_parameters(32768) == 111_008_256
    assert r.evaluate.reference["pass@1"] == pytest.approx(0.038)


def test_family_picks_variant_by_gpu_count_and_keeps_global_batch():
    eight = config.resolve_recipe_path("codeparrot-small", gpus=8)
    one = config.resolve_recipe_path("codeparrot-small", gpus=1)
    default = config.resolve_recipe_path("codeparrot-small", gpus=3)
    assert eight.stem == "codeparrot-small-8gpu" and one.stem == "codeparrot-small-1gpu"
    assert default == eight
    r8, r1 = load_recipe(str(eight)), load_recipe(str(one))
    assert r8.training.global_batch_size == r1.training.global_batch_size == 192
    assert (r8.num_micro_batches, r1.num_micro_batches) == (2, 16)


def test_unknown_key_names_the_closest_valid_one():
    with pytest.raises(UserError, match=r"unknown key 'training.learning_rate'"):
        recipe_from_dict(minimal(training={"learning_rate": 1e-3}))
    with pytest.raises(UserError, match=r"unknown key 'model.num_layer'; did you mean 'num_layers'"):
        recipe_from_dict(minimal(model={"num_layer": 2}))
    with pytest.raises(UserError, match=r"unknown key 'trainig'; did you mean 'training'"):
        recipe_from_dict(minimal(trainig={}))
    with pytest.raises(UserError, match=r"unknown key 'model.lr'; it belongs in another section: 'training.lr'"):
        recipe_from_dict(minimal(model={"lr": 1e-3}))


def test_wrong_type_names_key_value_and_expected_type():
    with pytest.raises(UserError, match=r"model.hidden_size: got 'big' \(str\), expected int"):
        recipe_from_dict(minimal(model={"hidden_size": "big"}))
    with pytest.raises(UserError, match=r"training.fp16: got 1 \(int\), expected bool"):
        recipe_from_dict(minimal(training={"fp16": 1}))
    with pytest.raises(UserError, match=r"lr_decay_style: got 'cos', expected one of"):
        recipe_from_dict(minimal(training={"lr_decay_style": "cos"}))


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"training": {"micro_batch_size": 4, "global_batch_size": 10}}, "not a multiple of micro_batch_size 4"),
        (
            {
                "parallel": {"world_size": 4, "tensor_model_parallel_size": 2},
                "training": {"micro_batch_size": 3, "global_batch_size": 3},
            },
            "data-parallel size 2",
        ),
        (
            {"model": {"num_attention_heads": 12}, "parallel": {"world_size": 8, "tensor_model_parallel_size": 8}},
            "not divisible by TP 8",
        ),
        (
            {"model": {"num_layers": 12}, "parallel": {"world_size": 5, "pipeline_model_parallel_size": 5}},
            "not divisible by PP 5",
        ),
        (
            {"model": {"seq_length": 2048, "max_position_embeddings": 1024}},
            "seq_length 2048 > model.max_position_embeddings 1024",
        ),
        ({"parallel": {"world_size": 6, "tensor_model_parallel_size": 4}}, "world_size 6 is not divisible"),
        ({"model": {"make_vocab_size_divisible_by": 0}}, "model.make_vocab_size_divisible_by must be >= 1"),
        ({"parallel": {"sequence_parallel": True}}, "sequence_parallel needs tensor_model_parallel_size > 1"),
        ({"training": {"fp16": True, "bf16": True}}, "choose one"),
        ({"data": {"split": "a,b"}}, "data.split"),
        ({"tokenizer": {"vocab_file": "v.json"}}, "give both or neither"),
        ({"training": {"lr": 0.0}}, r"training.lr must be > 0 \(got 0.0\)"),
        ({"training": {"clip_grad": -1.0}}, r"training.clip_grad must be >= 0 \(0 turns clipping off; got -1.0\)"),
        ({"training": {"fp16": True, "min_loss_scale": 0.0}}, r"training.min_loss_scale 0.0 must be in \(0, "),
    ],
)
def test_impossible_combinations_refused(sections, message):
    with pytest.raises(UserError, match=message):
        recipe_from_dict(minimal(**sections))


def test_overrides_are_typed_and_recorded():
    r = load_recipe("smoke", ["lr=2e-3", "training.train_iters=7", "json_keys=[content, text]", "fp16=true"])
    assert r.training.lr == 2e-3 and isinstance(r.training.lr, float)
    assert r.training.train_iters == 7 and r.data.json_keys == ["content", "text"] and r.training.fp16
    assert r.overrides == ["lr=2e-3", "training.train_iters=7", "json_keys=[content, text]", "fp16=true"]
    with pytest.raises(UserError, match="did you mean 'lr'"):
        load_recipe("smoke", ["lrr=1"])
    with pytest.raises(UserError, match="expected key=value"):
        load_recipe("smoke", ["lr"])
    with pytest.raises(UserError, match="training.train_iters: got 'many'"):
        load_recipe("smoke", ["train_iters=many"])


def test_hash_is_stable_and_changes_with_any_value(tmp_path):
    a, b = load_recipe("smoke"), load_recipe("smoke")
    assert a.hash == b.hash and len(a.hash) == 16
    # The same recipe written in another order and with defaults spelled out hashes the same.
    raw = yaml.safe_load(open(config.resolve_recipe_path("smoke")))
    raw["model"]["init_method_std"] = 0.02
    reordered = dict(reversed(list(raw.items())))
    path = tmp_path / "same.yaml"
    path.write_text(yaml.safe_dump(reordered))
    assert load_recipe(str(path)).hash == a.hash
    c = load_recipe("smoke", ["seed=1"])
    assert c.hash != a.hash and a.diff(c.to_dict()) == ["training.seed"]


def test_stage_hashes_follow_what_each_stage_depends_on():
    base = load_recipe("smoke")
    lr = load_recipe("smoke", ["lr=5e-3"])
    vocab = load_recipe("smoke", ["tokenizer.vocab_size=600"])
    docs = load_recipe("smoke", ["corpus.max_documents=61"])
    for stage in ("corpus", "tokenizer", "preprocess"):
        assert base.stage_hash(stage) == lr.stage_hash(stage)
    assert base.stage_hash("train") != lr.stage_hash("train")
    assert base.stage_hash("corpus") == vocab.stage_hash("corpus")
    assert base.stage_hash("tokenizer") != vocab.stage_hash("tokenizer")
    assert base.stage_hash("preprocess") != vocab.stage_hash("preprocess")
    assert base.stage_hash("corpus") != docs.stage_hash("corpus")
    keys = load_recipe("smoke", ["data.json_keys=[text]"])  # the tokenizer is trained on these texts
    assert base.stage_hash("corpus") == keys.stage_hash("corpus")
    assert base.stage_hash("tokenizer") != keys.stage_hash("tokenizer")
    evaluation = load_recipe("smoke", ["evaluate.humaneval_num_samples=8"])  # how a run is evaluated
    assert evaluation.hash != base.hash and evaluation.stage_hash("train") == base.stage_hash("train")


def test_every_shipped_recipe_loads():
    names = [p.stem for p in config.list_recipe_files()]
    assert {"codeparrot-small-8gpu", "codeparrot-small-1gpu", "codeparrot-tiny", "smoke", "smoke-tp2pp2"} <= set(names)
    for name in names:
        r = load_recipe(name)
        assert isinstance(r, Recipe) and r.version >= 1
        assert r.num_micro_batches >= 1


def test_unknown_recipe_name_suggests():
    with pytest.raises(UserError, match="did you mean 'codeparrot-tiny'"):
        load_recipe("codeparrot-tin")
    with pytest.raises(UserError, match="does not exist"):
        load_recipe("nope/missing.yaml")


def test_num_parameters_formula_small_case():
    r = recipe_from_dict(
        minimal(
            model={
                "num_layers": 1,
                "hidden_size": 8,
                "num_attention_heads": 2,
                "seq_length": 4,
                "max_position_embeddings": 4,
            },
            tokenizer={"vocab_size": 100},
        )
    )
    v, h = r.padded_vocab_size(100), 8
    assert v == 128
    per_layer = 2 * (2 * h) + (3 * h * h + 3 * h) + (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h)
    assert r.num_parameters() == v * h + 4 * h + per_layer + 2 * h
    assert math.isclose(r.tokens_to_train(), r.training.train_iters * r.training.global_batch_size * 4)


VPP = {"model": {"num_layers": 8}, "parallel": {"world_size": 2, "pipeline_model_parallel_size": 2}}


@pytest.mark.parametrize(
    "layers_per_stage, num_layers, pp, global_batch, message",
    [
        (
            3,
            8,
            2,
            4,
            "model.num_layers 8 is not divisible by pipeline_model_parallel_size 2 x "
            "parallel.num_layers_per_virtual_pipeline_stage 3 = 6",
        ),
        (
            2,
            8,
            2,
            3,
            r"number of micro batches per iteration \(3 = .*\) to be a multiple of "
            "pipeline_model_parallel_size 2",
        ),
        (2, 8, 1, 4, "needs pipeline_model_parallel_size >= 2 \\(got 1\\)"),
        (0, 8, 2, 4, "must be >= 1 or null \\(got 0\\)"),
    ],
)
def test_virtual_pipeline_stages_refused_with_the_numbers(layers_per_stage, num_layers, pp, global_batch, message):
    with pytest.raises(UserError, match=message):
        recipe_from_dict(
            minimal(
                model={"num_layers": num_layers},
                parallel={
                    "world_size": pp,
                    "pipeline_model_parallel_size": pp,
                    "num_layers_per_virtual_pipeline_stage": layers_per_stage,
                },
                training={"micro_batch_size": 1, "global_batch_size": global_batch},
            )
        )


def test_virtual_pipeline_stages_count_and_hash():
    plain = recipe_from_dict(minimal(**VPP))
    assert plain.parallel.virtual_pipeline_model_parallel_size(8) is None
    assert plain.to_dict()["parallel"]["num_layers_per_virtual_pipeline_stage"] is None  # resolved, as every key
    chunked = recipe_from_dict(
        minimal(
            model=VPP["model"],
            parallel={**VPP["parallel"], "num_layers_per_virtual_pipeline_stage": 2},
            training={"global_batch_size": 4},
        )
    )
    assert chunked.parallel.virtual_pipeline_model_parallel_size(8) == 2
    assert "x 2 virtual stages" in chunked.describe()
    assert (
        chunked.hash
        != recipe_from_dict(
            minimal(model=VPP["model"], parallel=VPP["parallel"], training={"global_batch_size": 4})
        ).hash
    )
    assert plain.diff(chunked.to_dict()) == [
        "parallel.num_layers_per_virtual_pipeline_stage",
        "training.global_batch_size",
    ]


def test_a_key_added_to_the_schema_later_is_no_change_at_its_default():
    """A checkpoint written before the schema had a key resumes while the key keeps its default
    (the run that wrote it used that default); a non-default value is a change."""
    recipe = load_recipe("smoke")
    older = recipe.to_dict()
    del older["training"]["accumulate_allreduce_grads_in_fp32"]
    assert recipe.diff(older) == []
    changed = load_recipe("smoke", ["accumulate_allreduce_grads_in_fp32=true"])
    assert changed.diff(older) == ["training.accumulate_allreduce_grads_in_fp32"]
