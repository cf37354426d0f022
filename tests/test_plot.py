"""``bitune plot``: the mixing figures drawn from a real training log, the attention maps of a model."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from bitune import BituneConfig, BituneModel
from bitune.cli import main
from bitune.data.collate import Collator
from bitune.errors import BituneError
from bitune.generation import encode, render
from bitune.plot import (
    FINAL_FILE,
    STEPS_FILE,
    attention_figure,
    attention_maps,
    mixing_figures,
    read_mixing_log,
    token_labels,
)
from bitune.train.run_folder import LOG_FILE
from bitune.train.settings import TrainSettings
from bitune.train.trainer import build_trainer, run_training
from helpers.gen import perturbed_bitune, save_checkpoint
from helpers.models import CONFIGS, EOS, VOCAB
from helpers.tokenizer import tiny_tokenizer

LAYERS = 3


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """Three real training steps of a 3-layer tiny Llama: (run folder, trained model)."""
    out = tmp_path_factory.mktemp("plot") / "run"
    settings = TrainSettings.from_dict(dict(model="tiny", dataset="tiny", output_dir=str(out), batch_size=2,
                                            grad_accum=1, steps=3, lr=5e-2, log_every=1, seed=0,
                                            bitune={"variant": "bitune"}))
    transformers.set_seed(0)
    config = CONFIGS["llama"]()
    config.num_hidden_layers = LAYERS
    model = BituneModel.wrap(transformers.AutoModelForCausalLM.from_config(config).eval(), settings.bitune)
    g = torch.Generator().manual_seed(0)
    data = [{"prompt_ids": torch.randint(3, VOCAB, (4,), generator=g).tolist(),
             "answer_ids": torch.randint(3, VOCAB, (2,), generator=g).tolist() + [EOS]} for _ in range(6)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before the autouse one_thread
    try:
        run_training(build_trainer(model, settings, data, None, Collator(0), tensorboard=False), settings)
    finally:
        torch.set_num_threads(threads)
    return out, model


def test_mixing_figures_have_one_curve_per_layer_and_end_at_the_trained_ratios(trained_run):
    run, model = trained_run
    steps, ratios = read_mixing_log(run / LOG_FILE)
    start = [pytest.approx(BituneConfig().init_share)] * LAYERS  # the run's recorded share (the default: 0.1)
    assert steps == [0, 1, 2, 3] and ratios["k"][0] == ratios["v"][0] == start  # starts at the initial a
    curves, final = mixing_figures(steps, ratios)
    panels = [ax for ax in curves.axes if ax.get_lines()]
    assert len(panels) == 2 and len(curves.axes) == 3  # K, V and the layer colorbar
    for ax, key in zip(panels, ("k", "v")):
        assert len(ax.get_lines()) == LAYERS
        for layer, line in enumerate(ax.get_lines()):
            assert list(line.get_xdata()) == steps
            assert list(line.get_ydata()) == [r[layer] for r in ratios[key]]
        assert ax.get_xlabel() == "training step" and f"a_{key}" in ax.get_title()
    trained = model.mixing_ratios()
    assert not torch.allclose(trained["k"], torch.full((LAYERS,), BituneConfig().init_share))  # training moved them
    (ax,) = final.axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    for key in ("k", "v"):
        line = lines[f"$a_{key}$"]
        assert list(line.get_xdata()) == list(range(LAYERS))
        torch.testing.assert_close(torch.tensor(line.get_ydata(), dtype=torch.float32), trained[key],
                                   atol=1e-6, rtol=0)
    assert ax.get_legend() is not None and ax.get_xlabel() == "layer index"


def test_plot_mixing_cli_writes_both_pngs(trained_run, tmp_path):
    run, _ = trained_run
    assert main(["plot", "mixing", "--log", str(run / LOG_FILE), "--output", str(tmp_path)]) == 0
    for name in (STEPS_FILE, FINAL_FILE):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_shorter_than_log_every_plots_a_line_from_step_0_and_warns(tmp_path, capsys):
    """Two steps with log_every=10: only the end-of-training line holds ratios; the curves still show."""
    run = tmp_path / "run"
    settings = TrainSettings.from_dict(dict(model="tiny", dataset="tiny", output_dir=str(run), batch_size=2,
                                            grad_accum=1, steps=2, lr=5e-2, log_every=10, seed=0))
    transformers.set_seed(0)
    model = BituneModel.wrap(transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"]()).eval(),
                             settings.bitune)
    data = [{"prompt_ids": [5, 6, 7, 8], "answer_ids": [9, 10, EOS]}] * 4
    run_training(build_trainer(model, settings, data, None, Collator(0), tensorboard=False), settings)
    out = tmp_path / "fig"
    assert main(["plot", "mixing", "--log", str(run / LOG_FILE), "--output", str(out)]) == 0
    assert "one training step only (step 2" in capsys.readouterr().err
    steps, ratios = read_mixing_log(run / LOG_FILE)
    assert steps == [0, 2]
    curves, _ = mixing_figures(steps, ratios)
    assert "only step 2 was logged" in curves.get_suptitle()
    for ax in curves.axes[:2]:
        for line in ax.get_lines():
            assert list(line.get_xdata()) == [0, 2] and line.get_marker() == "o"
            assert line.get_ydata()[0] == pytest.approx(settings.bitune.init_share)  # the share the run recorded


def test_log_without_mixing_ratios_is_a_one_line_error(tmp_path, capsys):
    log = tmp_path / LOG_FILE
    log.write_text('{"step": 1, "loss": 2.0, "lr": 0.001}\n')
    assert main(["plot", "mixing", "--log", str(log), "--output", str(tmp_path)]) == 2
    assert "holds no mixing ratios" in capsys.readouterr().err


GOOD = '{"step": 2, "a_k": [0.4, 0.6], "a_v": [0.5, 0.5]}'


@pytest.mark.parametrize("line, message", [
    ('{"a_k": [0.4, 0.6], "a_v": [0.5, 0.5]}', "'step' is None"),
    ('{"step": -3, "a_k": [0.4, 0.6], "a_v": [0.5, 0.5]}', "'step' is -3"),
    ('{"step": 3, "a_k": null, "a_v": [0.5, 0.5]}', "a_k is None; expected a list"),
    ('{"step": 3, "a_k": 0.5, "a_v": [0.5, 0.5]}', "a_k is 0.5; expected a list"),
    ('{"step": 3, "a_k": [], "a_v": []}', "a_k is []"),
    ('{"step": 3, "a_k": [0.4, NaN], "a_v": [0.5, 0.5]}', "a_k[1] is nan"),
    ('{"step": 3, "a_k": [0.4, 1e300], "a_v": [0.5, 0.5]}', "a_k[1] is 1e+300"),
    ('{"step": 3, "a_k": [0.4, true], "a_v": [0.5, 0.5]}', "a_k[1] is True"),
    ('{"step": 3, "a_k": [0.4, [0.5]], "a_v": [0.5, 0.5]}', "a_k[1] is [0.5]"),
    ('{"step": 3, "a_k": [0.4, "x"], "a_v": [0.5, 0.5]}', "a_k[1] is 'x'"),
    ('{"step": 3, "a_k": [0.4], "a_v": [0.5]}', "different number of layers"),
])
def test_a_malformed_mixing_line_is_a_one_line_error_naming_it(tmp_path, capsys, line, message):
    """A figure drawn from values that cannot be mixing ratios would be a silently wrong figure."""
    log = tmp_path / LOG_FILE
    log.write_text(f'{GOOD}\n"a text line"\n\n{line}\n')
    assert main(["plot", "mixing", "--log", str(log), "--output", str(tmp_path / "fig")]) == 2
    err = capsys.readouterr().err
    assert f"{log}:4: " in err and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "fig").exists()


def test_attention_figure_shows_causal_and_bidirectional_maps_with_token_labels():
    tok, model = tiny_tokenizer(), perturbed_bitune()
    ids, mask = encode(tok, [render(tok, "why is the sky blue?")[0]], True)
    maps = attention_maps(model.weights, model.config.passes, model.text_config, ids, mask)
    maps = {k: m[0] for k, m in maps.items()}  # (T, T) each
    labels = token_labels(tok, ids[0, :-1].tolist())
    fig = attention_figure(maps, labels)
    images = [ax for ax in fig.axes if ax.get_images()]
    assert [ax.get_title() for ax in images] == ["causal pass (causal weights, causal mask)",
                                                 "bidirectional pass (bidir weights, no mask)"]
    causal, bidir = (torch.tensor(ax.get_images()[0].get_array()) for ax in images)
    T = len(labels)
    assert causal.shape == bidir.shape == (T, T)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)  # keys after the query
    assert causal[future].max() == 0 and bidir[future].min() > 0  # only the bidirectional pass sees ahead
    torch.testing.assert_close(causal.sum(1), torch.ones(T, dtype=causal.dtype))  # rows are attention distributions
    for ax in images:
        assert [t.get_text() for t in ax.get_xticklabels()] == labels
        assert [t.get_text() for t in ax.get_yticklabels()] == labels
    assert labels[:3] == ["<s>", "Q", "u"] and "␣" in labels


def test_long_prompts_are_drawn_without_token_labels():
    maps = {"causal/causal": torch.eye(50)}
    (ax, _) = attention_figure(maps, [str(i) for i in range(50)], max_labels=40).axes  # map and colorbar
    assert [t.get_text() for t in ax.get_xticklabels()][:1] != ["0"]


def test_plot_attention_cli_writes_a_png(tmp_path):
    ckpt, _ = save_checkpoint(tmp_path)
    out = tmp_path / "fig"
    assert main(["plot", "attention", "--checkpoint", str(ckpt), "--prompt", "what is 2+2?", "--output", str(out),
                 "--device", "cpu"]) == 0
    assert (out / "attention.png").read_bytes()[:4] == b"\x89PNG"


def test_negative_max_labels_is_refused_before_loading(tmp_path, capsys):
    assert main(["plot", "attention", "--model", str(tmp_path / "no-model"), "--prompt", "hi", "--max-labels", "-5",
                 "--output", str(tmp_path)]) == 2
    assert "--max-labels must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("prompt", ["", "   ", "\ud800"])
def test_an_empty_or_broken_prompt_is_refused_before_loading(tmp_path, capsys, prompt):
    """The rule generate applies: an empty prompt, or text that is not valid Unicode, is one error."""
    assert main(["plot", "attention", "--model", str(tmp_path / "no-model"), "--prompt", prompt,
                 "--output", str(tmp_path / "out")]) == 2
    assert "--prompt" in capsys.readouterr().err


def test_a_run_started_near_causal_starts_its_curves_at_its_recorded_share(tmp_path):
    from bitune.plot import read_mixing_log

    (tmp_path / "log.jsonl").write_text(json.dumps({"step": 5, "a_k": [0.2, 0.3], "a_v": [0.1, 0.15]}) + "\n")
    assert read_mixing_log(tmp_path / "log.jsonl")[1]["k"][0] == [0.5, 0.5]  # no settings.yaml: the paper's start
    (tmp_path / "settings.yaml").write_text("seed: 42\nbitune:\n  variant: bitune\n  init_share: 0.1\n")
    steps, ratios = read_mixing_log(tmp_path / "log.jsonl")
    assert steps == [0, 5] and ratios["k"][0] == ratios["v"][0] == [0.1, 0.1]
    (tmp_path / "settings.yaml").write_text("bitune:\n  init_share: 1.5\n")
    with pytest.raises(BituneError, match=r"init_share=1.5 is not a share in \(0, 1\)"):
        read_mixing_log(tmp_path / "log.jsonl")
