"""Packs: round trip, stage invalidation, refusal of damaged, foreign and unfinished packs, and
``jpinfer.load(pack=...)`` building the same engines as the pack's artifacts given by hand."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jpinfer
from jpinfer import JpinferError
from jpinfer.cache import CacheWarning
from jpinfer.models import quantized
from jpinfer.models.identity import model_fingerprint
from jpinfer.modes import ModeInputs, build_engine, get_mode
from jpinfer.pack import (
    STAGES,
    Pack,
    PackError,
    PackIncompleteError,
    PackMismatchError,
    PackSettings,
    pack_for,
    prepare,
)
from jpinfer.pack import stages as stages_module
from jpinfer.pack.store import MANIFEST
from jpinfer.predictor import PredictorMismatchError
from jpinfer.profiler import ProfileMismatchError, smoothing
from jpinfer.solver import InfeasibleBudgetError

from profiler_fixtures import FALCON_LIKE, GEMMA2_LIKE, GEMMA3_LIKE, tiny_engine

TEXT = " ".join(["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine",
                 "all that glitters is not gold", "where there is smoke there is fire"] * 120)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache for the module (predictor samples live there), restored after."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JPINFER_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "text.txt"
    corpus.write_text(TEXT)
    return PackSettings(corpus=str(corpus), window=32, calibration_tokens=256, n_tokens=1024, n_samples=512,
                        ranks=4, max_epochs=2, gpu_budget="0.9", context=64)


@pytest.fixture(scope="module")
def model():
    return tiny_engine("swiglu").model


@pytest.fixture(scope="module")
def made(cache, settings, model, tmp_path_factory):
    """A finished pack, prepared once; tests copy it before changing it."""
    path = tmp_path_factory.mktemp("packs") / "pack"
    return prepare(model, path, settings, progress=False)


@pytest.fixture
def pack_dir(made, tmp_path):
    path = tmp_path / "pack"
    shutil.copytree(made.path, path)
    return path


def targets_of(settings: PackSettings, ffn_kind: str, weights: str = "float") -> dict:
    """The threshold mode's targets per kind (those on) that ``settings`` ask of a model of ``ffn_kind``."""
    asked = settings.threshold_targets(ffn_kind, weights)
    targets = {"activation": asked["activation"], "input": asked["input"], "qkv": asked.get("attention"),
               "o": asked.get("attention"), "head": asked.get("head")}
    return {kind: target for kind, target in targets.items() if target is not None}


def finished(path) -> dict:
    return {stage: entry["finished"] for stage, entry in json.loads((path / MANIFEST).read_text())["stages"].items()}


def test_round_trip(made, model):
    assert made.ran == STAGES
    loaded = Pack.load(made.path, model)
    assert loaded.ran == () and loaded.settings == made.settings
    np.testing.assert_array_equal(loaded.profile.counts, made.profile.counts)
    np.testing.assert_array_equal(loaded.profile.thresholds, made.profile.thresholds)
    assert loaded.profile.sparsity_thresholds().to_dict() == made.thresholds.to_dict()
    for a, b in zip(loaded.predictors.layers, made.predictors.layers):
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for a, b in zip(loaded.placement.masks(), made.placement.masks()):
        np.testing.assert_array_equal(a, b)
    # the stages computed what their functions compute from the same inputs
    assert made.predictors.meta["profile_fingerprint"] == jpinfer.predictor.profile_fingerprint(made.profile)
    assert made.thresholds.target == targets_of(made.settings, model.cfg.ffn_kind)


def test_prepare_again_reuses_every_stage(made, model, pack_dir):
    before = (pack_dir / MANIFEST).read_bytes()
    again = prepare(model, pack_dir, made.settings, progress=False)
    assert again.ran == ()
    assert (pack_dir / MANIFEST).read_bytes() == before  # nothing rewritten


@pytest.mark.parametrize("change, stages", [
    ({"recall": 0.9}, ("predictors", "placement")),
    ({"gpu_budget": "0.95"}, ("placement",)),
    ({"objective": "latency"}, ("placement",)),
    ({"threshold_sparsity": 0.3}, ("thresholds",)),
    ({"input_sparsity": 0.2}, ("thresholds",)),
    ({"attention_sparsity": 0.2}, ("thresholds",)),
    ({"head_sparsity": 0.3}, ("thresholds",)),
    ({"head_sparsity": None}, ("thresholds",)),
    # slow: a model-wide calibration (its greedy allocation measures candidates); the changes above redo the same stage
    pytest.param({"model_wide_sparsity": 0.3}, ("thresholds",), marks=pytest.mark.slow),
    ({"n_samples": 256}, ("profile", "predictors", "placement")),
    ({"sparsity": 0.6}, ("profile", "thresholds", "predictors", "placement")),  # thresholds follow sparsity
    ({"calibration_tokens": 512}, STAGES),
])
def test_a_changed_setting_redoes_exactly_what_depends_on_it(made, model, pack_dir, change, stages):
    before = finished(pack_dir)
    pack = prepare(model, pack_dir, dataclasses.replace(made.settings, **change), progress=False)
    assert pack.ran == stages
    after = finished(pack_dir)
    assert {s for s in STAGES if after[s] != before[s]} <= set(stages)  # the others kept their entries
    assert {s: after[s] for s in STAGES if s not in stages} == {s: before[s] for s in STAGES if s not in stages}
    assert Pack.load(pack_dir, model).settings == dataclasses.replace(made.settings, **change)


def test_a_calibration_without_the_heads_histogram_is_taken_again(made, model, pack_dir, monkeypatch):
    """A pack whose calibration was written before the head's histogram existed: for a head target the thresholds
    stage takes the histograms again (not stored: the calibration's key, and the stages after it, stay valid)."""
    load = stages_module.LOADERS["calibration"]
    monkeypatch.setitem(stages_module.LOADERS, "calibration",
                        lambda path: {kind: h for kind, h in load(path).items() if kind != "head"})
    pack = prepare(model, pack_dir, dataclasses.replace(made.settings, head_sparsity=0.3), progress=False)
    assert pack.ran == ("thresholds",)
    expected = jpinfer.profiler.uniform(made.calibration_histograms()["head"], 0.3).thresholds[0]
    assert pack.thresholds.head == float(expected)  # the same windows, the same counts: the same threshold
    assert made.thresholds.head is not None  # "auto": on for float weights


def test_another_dtype_redoes_only_the_placement(made, pack_dir):
    bf16 = tiny_engine("swiglu").model
    bf16 = dataclasses.replace(bf16, weights=jax.tree_util.tree_map(lambda a: a.astype("bfloat16"), bf16.weights))
    pack = prepare(bf16, pack_dir, made.settings, progress=False)
    assert pack.ran == ("placement",) and pack.dtype == "bfloat16"


@pytest.mark.parametrize("target", ["profile.npz", "calibration.npz", "thresholds.json", "predictors",
                                    "placement/placement.npz"])
def test_a_damaged_file_is_refused_then_redone(made, model, pack_dir, target):
    path = pack_dir / target
    if path.is_dir():
        path = max((f for f in path.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(PackError, match="checksum mismatch|changed since"):
        Pack.load(pack_dir, model)
    with pytest.warns(CacheWarning, match="redoing"):
        pack = prepare(model, pack_dir, made.settings, progress=False)
    stage = target.split(".")[0].split("/")[0]
    first = STAGES.index(stage)
    dependents = {stage} | {s for s in STAGES[first:] if _reads(s, stage)}
    assert set(pack.ran) == dependents
    Pack.load(pack_dir, model)


def _reads(stage: str, upstream: str) -> bool:
    from jpinfer.pack.settings import DEPENDS

    return upstream in DEPENDS[stage] or any(_reads(d, upstream) for d in DEPENDS[stage])


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.update(version=99), "version 99.*newer"),
    (lambda m: m["settings"].update(recall=0.5), "checksum mismatch|changed since"),
    (lambda m: m.update(format="something"), "not a jpinfer pack"),
])
def test_a_damaged_or_other_version_manifest_is_refused(model, pack_dir, edit, match):
    manifest = json.loads((pack_dir / MANIFEST).read_text())
    edit(manifest)
    (pack_dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(PackError, match=match):
        Pack.load(pack_dir, model)


def test_a_missing_manifest_or_directory_is_refused(model, pack_dir, tmp_path):
    with pytest.raises(PackError, match="no such pack directory"):
        Pack.load(tmp_path / "nowhere")
    (pack_dir / MANIFEST).unlink()
    with pytest.raises(PackError, match="not a jpinfer pack"):
        Pack.load(pack_dir)


def test_a_foreign_pack_is_refused_and_not_overwritten(made, model, pack_dir):
    other = tiny_engine("swiglu", seed=1).model
    with pytest.raises(PackMismatchError, match="prepared for model 'tiny-swiglu'.*the same name and format with "
                                                r"other weight values.*jpinfer prepare --model tiny-swiglu\)"):
        Pack.load(pack_dir, other)
    with pytest.raises(PackMismatchError, match="not for model 'tiny-relu'.*: another model: .*jpinfer prepare"):
        Pack.load(pack_dir, tiny_engine("relu").model)
    with pytest.raises(PackMismatchError, match="prepared for model"):
        pack_for(other, pack_dir)
    assert pack_for(model, pack_dir).settings == made.settings
    before = (pack_dir / MANIFEST).read_bytes()
    with pytest.raises(PackMismatchError, match="not overwritten"):
        prepare(other, pack_dir, made.settings, progress=False)
    assert (pack_dir / MANIFEST).read_bytes() == before


def test_an_interrupted_prepare_leaves_an_unfinished_pack_that_resumes(made, model, pack_dir, monkeypatch):
    changed = dataclasses.replace(made.settings, recall=0.8)

    def interrupted(run):
        raise KeyboardInterrupt

    monkeypatch.setitem(stages_module.RUNNERS, "placement", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(model, pack_dir, changed, progress=False)
    with pytest.raises(PackIncompleteError, match="unfinished.*predictors"):
        Pack.load(pack_dir, model)
    monkeypatch.undo()
    pack = prepare(model, pack_dir, changed, progress=False)
    assert pack.ran == ("placement",)  # the predictors finished before the interruption
    assert Pack.load(pack_dir, model).settings.recall == 0.8


def test_a_directory_with_other_files_is_not_written_into(made, model, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(JpinferError, match="not a pack"):
        prepare(model, tmp_path, made.settings, progress=False)
    assert (tmp_path / "notes.txt").read_text() == "mine" and not (tmp_path / MANIFEST).exists()


def test_missing_predictor_samples_redo_the_profile_when_the_predictors_rerun(made, model, pack_dir, cache):
    shutil.rmtree(cache / "samples")
    pack = prepare(model, pack_dir, dataclasses.replace(made.settings, recall=0.95), progress=False)
    assert pack.ran == ("profile", "predictors", "placement")
    np.testing.assert_array_equal(pack.profile.counts, made.profile.counts)  # the same pass again


@pytest.mark.parametrize("change, match", [
    ({"sparsity": 1.0}, "fraction of inactive neurons"),
    ({"hardware": "tpu9000"}, "hardware must be a preset"),
    ({"objective": "speed"}, "objective must be one of"),
    ({"recall": 0.0}, "recall must lie in"),
    ({"n_tokens": 8}, "at least one window"),
    ({"input_sparsity": 1.5}, "threshold mode settings"),
    ({"ranks": 0}, "ranks must be None"),
])
def test_bad_settings_are_refused(settings, change, match):
    with pytest.raises(JpinferError, match=match):
        dataclasses.replace(settings, **change)


def test_unknown_setting_and_infeasible_budget_fail_before_any_stage(made, model, tmp_path):
    with pytest.raises(JpinferError, match="sparsty"):
        prepare(model, tmp_path / "a", made.settings, sparsty=0.5, progress=False)
    with pytest.raises(InfeasibleBudgetError, match="raise the budget"):
        prepare(model, tmp_path / "b", made.settings, gpu_budget="1KB", progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("mode", ["sparse", "hybrid", "threshold"])
def test_a_packs_mode_arguments_build_the_engine_of_its_artifacts(made, model, mode):
    inputs = get_mode(mode).from_pack(made, "float32", ModeInputs())
    direct = build_engine(model, mode, **{k: v for k, v in vars(inputs).items() if k != "capacity"})
    expected = {"sparse": dict(predictors=made.predictors, profile=made.profile),
                "hybrid": dict(predictors=made.predictors, profile=made.profile, placement=made.placement),
                "threshold": dict(profile=made.profile)}[mode]
    by_hand = build_engine(model, mode, **expected)
    prompt = [1, 5, 9, 12, 3]
    assert direct.generate(prompt, max_new_tokens=6).token_ids == by_hand.generate(prompt, max_new_tokens=6).token_ids


def test_what_a_mode_takes_from_a_pack_given_values_win(made):
    from_pack = lambda mode, dtype, **given: get_mode(mode, thresholds=given.get("thresholds")).from_pack(
        made, dtype, ModeInputs(**given))
    args = from_pack("hybrid", "float32", gpu_budget="0.5")
    assert args.placement is None and args.gpu_budget == "0.5" and args.predictors is made.predictors
    assert from_pack("hybrid", "float32").placement is made.placement
    assert from_pack("sparse", "float32").placement is None
    threshold = from_pack("threshold", "float32")
    assert threshold.predictors is None and threshold.profile is made.profile
    hybrid_threshold = from_pack("hybrid", "float32", thresholds="profile")
    assert hybrid_threshold.predictors is None and hybrid_threshold.placement is made.placement
    assert from_pack("hybrid", "bfloat16").gpu_budget == made.settings.gpu_budget  # re-solved
    assert from_pack("dense", "float32") == ModeInputs()


@pytest.fixture(scope="module")
def quantized_packs(cache, settings, model):
    """Packs of the int8 and int4 forms of the tiny model (int8 after SmoothQuant's migration, calibrated on a
    few windows; int4: 4-bit gate/up, int8 down, since d_ff 48 is no multiple of 32), in the cache's default
    place (``out`` None)."""
    windows = np.random.default_rng(0).integers(0, 40, (4, 32)).astype(np.int32)
    forms = {"int8": smoothing.int8_model(model, windows),
             "int4": dataclasses.replace(model, weights=quantized.quantize_weights(model.weights, "int4"))}
    return {fmt: (m, prepare(m, None, settings, progress=False)) for fmt, m in forms.items()}


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantized_model_gets_a_pack_of_its_own(quantized_packs, made, model, fmt):
    """Every stage runs on the quantized model: its profile and predictors are its own (the float model's are
    refused for it, saying the format differs), the threshold mode and the hybrid build from the pack and decode,
    the hybrid's parts in the model's format, and the default place is per weights format."""
    qmodel, pack = quantized_packs[fmt]
    assert pack.ran == STAGES and pack.weights == fmt and made.weights == "float"
    assert pack.thresholds.target == targets_of(made.settings, "swiglu", fmt)
    assert (pack.thresholds.input is None) == (fmt == "int4")  # "auto": no int8 copies of the 4-bit blocks
    assert pack.path.name.startswith(f"tiny-swiglu-{fmt}-") and pack.path.parent.name == "packs"
    assert pack.manifest["model"]["fingerprint"] == model_fingerprint(qmodel.cfg, qmodel.weights)
    assert Pack.load(pack.path, qmodel).settings == made.settings
    assert not np.array_equal(pack.profile.counts, made.profile.counts)  # the quantized model's own activity
    differs = f"it differs in weights format {fmt} there, float here"
    with pytest.raises(PackMismatchError, match=f"{differs}: make one for this model \\(jpinfer prepare "
                                                "--model tiny-swiglu\\)"):
        Pack.load(pack.path, model)
    with pytest.raises(ProfileMismatchError, match=f"this profile was made for model 'tiny-swiglu' \\({fmt} weights"
                                                   f".*{differs}.*jpinfer profile --out PATH --model tiny-swiglu\\)"):
        pack.profile.check_model(model)
    with pytest.raises(PredictorMismatchError, match=f"{differs}: make one for this model \\(jpinfer "
                                                     "train-predictors --model tiny-swiglu\\)"):
        pack.predictors.check_model(model)
    with pytest.raises(PackMismatchError, match=f"weights format float there, {fmt} here.*--weights {fmt}\\)"):
        Pack.load(made.path, qmodel)
    engine = build_engine(qmodel, "threshold", profile=pack.profile)
    assert engine.stepper.name == "threshold" and len(engine.generate([1, 5, 9], max_new_tokens=4).token_ids) == 4
    halves = [np.arange(qmodel.cfg.d_ff) % 2 == 0] * qmodel.cfg.n_layers  # the tiny pack's placement holds every neuron
    hybrid = build_engine(qmodel, "hybrid", predictors=pack.predictors, profile=pack.profile, placement=halves)
    assert all(part.rows.dtype == jnp.int8 and part.n_neurons == qmodel.cfg.d_ff // 2 for part in hybrid.ffn.impl.cold)
    assert len(hybrid.generate([1, 5, 9], max_new_tokens=4).token_ids) == 4


@pytest.mark.parametrize("kind, arch", [
    pytest.param("geglu", GEMMA2_LIKE, id="gemma2-like"), pytest.param("geglu", GEMMA3_LIKE, id="gemma3-like"),
    pytest.param("gelu", FALCON_LIKE, id="falcon-like"),
    pytest.param("swiglu", dict(n_experts=4, experts_per_token=2), id="mixtral-like"),
    # slow: test_moe.py decodes this family like dense in every mode
    pytest.param("swiglu", dict(n_experts=4, experts_per_token=2, renormalize_experts=False, shared_experts=1),
                 marks=pytest.mark.slow, id="qwen2-moe-like")])
def test_every_stage_and_mode_runs_on_each_architecture(kind, arch, cache, settings, tmp_path):
    """A model with each architecture's features through every stage, then every mode built from the pack decodes:
    Gemma 2's norms, windows and caps and Gemma 3's q/k norms and two RoPE bases (GeGLU: the inactive neurons are
    small, not zero, so the thresholds are calibrated over zero); Falcon's side-by-side block with its ungated GELU;
    Mixtral-like experts (4 of 12 neurons, top 2: the profile counts the experts' neurons, the placement splits
    them, the predictors are trained on routed activations; Qwen2-MoE-like: top 2 of 3 not renormalized and a shared
    expert under its gate, always on). The int8 form (SmoothQuant's calibration walks the
    same layers, scaling the router too) gets a pack of its own, and its threshold and sparse modes decode."""
    model = tiny_engine(kind, **arch).model
    pack = prepare(model, tmp_path / "pack", settings, progress=False)
    assert pack.ran == STAGES and pack.thresholds.target == targets_of(settings, kind)
    assert pack.profile.counts.shape[-1] == model.cfg.d_ff
    if not model.cfg.n_experts:  # with experts, half the neurons are exactly zero on every token
        assert np.all(pack.profile.thresholds > 0)
    prompt = [1, 5, 9, 12, 3]
    for mode, thresholds in (("sparse", None), ("hybrid", None), ("threshold", None), ("hybrid", "profile")):
        inputs = get_mode(mode).from_pack(pack, "float32", ModeInputs())
        if thresholds:
            inputs = dataclasses.replace(inputs, predictors=None, thresholds=thresholds)
        engine = build_engine(model, mode, **{k: v for k, v in vars(inputs).items() if k != "capacity"})
        assert engine.stepper.name == mode
        assert len(engine.generate(prompt, max_new_tokens=6, ignore_eos=True).token_ids) == 6
    windows = np.random.default_rng(0).integers(0, 40, (4, 32)).astype(np.int32)
    qmodel = smoothing.int8_model(model, windows)
    qpack = prepare(qmodel, tmp_path / "int8", settings, progress=False)
    assert qpack.weights == "int8"
    for mode in ("threshold", "sparse"):
        inputs = get_mode(mode, weights="int8").from_pack(qpack, "float32", ModeInputs())
        engine = build_engine(qmodel, mode, **{k: v for k, v in vars(inputs).items() if k != "capacity"})
        assert len(engine.generate(prompt, max_new_tokens=6, ignore_eos=True).token_ids) == 6
