"""`parse-jax lower`: a pair given as config files only, lowered for CUDA and TPU, written with its report."""

import json

import jax

from parse_jax.checkpoints.hf import hf_config_dict
from parse_jax.cli import main
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.tasks import TOKENIZER_DIR
from tests.random_models import tiny_config

VOCAB = Tokenizer.from_folder(TOKENIZER_DIR).vocab_size


def config_file(tmp_path, name, **overrides):
    fields = dict(vocab_size=VOCAB, head_dim=128, num_heads=8, num_kv_heads=4, hidden_size=64, num_layers=1,
                  dtype="bfloat16", max_position_embeddings=1024)
    cfg = tiny_config("qwen3", **{**fields, **overrides})
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(hf_config_dict(cfg)))
    return path


def lower(tmp_path, *args, capsys=None):
    target, draft = config_file(tmp_path, "target"), config_file(tmp_path, "draft")
    return main(["lower", "--model", str(target), "--draft", str(draft), "--max-new-tokens", "16",
                 "--prompt-len", "12", "--max-draft-tokens", "16", "--max-prefixes", "4", *args, "-q"])


def test_lower_writes_the_programs_and_a_report(tmp_path, capsys):
    out = tmp_path / "lowered"
    assert lower(tmp_path, "--platform", "tpu", "--chip", "v6e", "--mesh", "data=2,model=4", "--batch-size", "2",
                 "--mode", "parse", "--rounds", "single", "--out", str(out)) == 0
    printed = capsys.readouterr().out
    assert "parse-single.round: lowered" in printed and "tpu_custom_call" in printed
    assert "memory (parse): batch 2 x 12 prompt + 16 new tokens fits a v6e chip (34.4 GB) of a data=2,model=4 mesh"\
        in printed
    report = json.loads((out / "report.json").read_text())
    run = report["runs"][0]
    assert (run["chip"], run["device_kind"], run["mesh"]) == ("v6e", "TPU v6 lite", {"data": 2, "model": 4})
    program = run["programs"][0]
    assert program["lowered"] and program["kernel"] and program["custom_calls"]["tpu_custom_call"] >= 1
    assert any("over ('data',)" in shape for shape in program["inputs"].values())
    assert run["memory"]["fits"] and run["memory"]["weights_bytes"] > 0
    exported = jax.export.deserialize(bytearray((out / "parse-single.round.jax_exported").read_bytes()))
    assert exported.platforms == ("tpu",) and exported.nr_devices == 8
    assert "tpu_custom_call" in (out / "parse-single.round.mlir").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["parse-single.round.jax_exported", "parse-single.round.mlir",
                                                     "report.json"]


def test_a_program_that_cannot_be_lowered_is_named_with_its_reason(tmp_path, capsys):
    """A 512-wide head: the Triton kernel refuses it, so the program is reported, not written (exit 1)."""
    target = config_file(tmp_path, "wide", head_dim=512)
    out = tmp_path / "lowered"
    rc = main(["lower", "--model", str(target), "--platform", "cuda", "--mode", "target", "--max-new-tokens", "16",
               "--prompt-len", "8", "--out", str(out), "-q"])
    assert rc == 1
    printed = capsys.readouterr().out
    assert "target.generate: NOT lowered: TileError: head_dim 512 cannot be tiled by the Triton kernel" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["runs"][0]["programs"][0]["lowered"] is False
    assert sorted(p.name for p in out.iterdir()) == ["report.json"]


def test_memory_only_plans_a_qwen3_8b_pair_at_once(capsys):
    assert main(["lower", "--model", "qwen3-8b", "--draft", "qwen3-0.6b", "--chip", "v5e", "--batch-size", "8",
                 "--prompt-len", "256", "--max-new-tokens", "512", "--memory-only", "-q"]) == 0
    assert capsys.readouterr().out.startswith(
        "memory (parse): batch 8 x 256 prompt + 512 new tokens does not fit a v5e chip (17.2 GB): weights 17.57 GB")


def test_the_smaller_batch_offered_fits_as_lower_plans_it(capsys):
    """"what would fit: batch 32" means `--batch-size 32` (that many prompts at once), and that run fits; it was
    planned as max_batch 32 over the 64 prompts (a served run, more cache), and offered 16."""
    args = ["lower", "--model", "qwen3-8b", "--draft", "qwen3-0.6b", "--mode", "parse", "--prompt-len", "256",
            "--max-new-tokens", "512", "--memory-only", "--chip", "v6e", "-q"]
    assert main(args + ["--batch-size", "64"]) == 0
    assert "does not fit a v6e chip" in (out := capsys.readouterr().out) and "what would fit: batch 32;" in out
    assert main(args + ["--batch-size", "32"]) == 0
    assert "batch 32 x 256 prompt + 512 new tokens fits a v6e chip" in capsys.readouterr().out


def test_a_pair_whose_vocabularies_differ_in_padding_is_planned(tmp_path, capsys):
    """Qwen2.5-7B has 152064 embedding rows and its 0.5B draft 151936: a config-only (shape-only) model is padded
    to the larger vocabulary like a loaded one, not refused with numpy's broadcast error."""
    from parse_jax.utils.paths import config_dir

    cfg = json.loads((config_dir() / "models" / "qwen3-0.6b.json").read_text())
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] + 128}))
    assert main(["lower", "--model", str(tmp_path / "big" / "config.json"), "--draft", "qwen3-0.6b", "--mode", "sd",
                 "--memory-only", "-q"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("memory (sd): batch 1 x 64 prompt + 256 new tokens fits")


def test_a_config_only_pair_of_two_vocabularies_is_refused_in_one_line(tmp_path, capsys):
    """A draft of another vocabulary (not padding) given as configs alone: refused naming both sizes, before the
    default EAGLE-3 head is blamed for the padded target's size."""
    from tests.models.hf_tiny import make_tiny_hf

    folder = make_tiny_hf("qwen3", tmp_path / "tiny")
    (folder / "tokenizer.json").unlink()  # config and weights only
    capsys.readouterr()
    for mode in ("target", "sd"):
        assert main(["lower", "--model", str(folder), "--draft", "llama3-1b", "--mode", mode, "--memory-only",
                     "-q"]) == 2
        err = capsys.readouterr().err
        assert "target and draft have different vocabularies (target 320 rows, draft 128256 rows" in err, err
        assert "\n" not in err.strip() and "EAGLE-3" not in err


def test_bad_lower_flags_are_one_line_errors(tmp_path, capsys):
    assert main(["lower", "--model", "qwen4-9b", "-q"]) == 2
    assert "model 'qwen4-9b' is neither a folder, a config.json file nor a shipped config; shipped: llama3-1b" in \
        capsys.readouterr().err
    assert main(["lower", "--platform", "cuda", "--chip", "v5e", "-q"]) == 2
    assert "chip v5e is a tpu chip, not a cuda one" in capsys.readouterr().err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert lower(tmp_path, "--mode", "target", "--out", str(tmp_path / "mine")) == 2
    assert "is not an earlier `parse-jax lower` folder" in capsys.readouterr().err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert main(["lower", "--memory-only", "--out", str(tmp_path / "x"), "-q"]) == 2
    assert "--out writes lowered programs: drop --memory-only" in capsys.readouterr().err
    assert main(["lower", "--mode", "fast"]) == 2
    assert "argument --mode: invalid choice: 'fast'" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("keep")  # refused before any lowering: no program line printed
    assert lower(tmp_path, "--mode", "target", "--out", str(tmp_path / "a_file")) == 2
    out, err = capsys.readouterr()
    assert "is not an earlier `parse-jax lower` folder" in err and "lowered in" not in out + err


def test_a_gpu_chip_alone_lowers_for_cuda(tmp_path, capsys):
    """`--chip h100` without `--platform` plans for cuda (the chip's platform), not the tpu default."""
    assert lower(tmp_path, "--mode", "target", "--chip", "h100", "--memory-only", "--json") == 0
    out = capsys.readouterr().out
    (run,) = json.loads(out[out.index("{"):])["runs"]
    assert (run["platform"], run["chip"]) == ("cuda", "h100")


def test_generate_in_target_mode_is_refused_before_decoding_on_a_device_too_small(tmp_path, capsys, monkeypatch):
    """`parse-jax generate --mode target` decodes outside the engine; it makes the engine's memory check first: on a
    device whose allocator offers 0.1 MB, one line naming the sizes, exit 2, nothing decoded."""
    from tests.lowering.test_memory import Device
    from tests.models.hf_tiny import make_tiny_hf

    folder = make_tiny_hf("qwen3", tmp_path / "hf", seed=1)
    small = Device(bytes_limit=10**5, device_kind="Fake accelerator", platform="fake")
    cpu = jax.devices()
    capsys.readouterr()  # the folder writer's progress
    monkeypatch.setattr(jax, "devices", lambda *a: [small] if not a else cpu)
    assert main(["generate", "--model", str(folder), "--mode", "target", "hello", "--max-new-tokens", "8",
                 "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "does not fit a Fake accelerator chip (0.1 MB): weights" in err, err
    assert small.asked == 1


def test_lower_takes_the_user_s_eagle3_head(tmp_path, capsys):
    """--eagle3 DIR: the programs are lowered with that head (its draft vocabulary and map), checked against the
    target first; without it, a default head of the target's full vocabulary."""
    from pathlib import Path

    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "eagle3"
    target = str(fixtures / "target" / "config.json")  # a head written by speculators' own classes for it
    out = tmp_path / "lowered"
    assert main(["lower", "--model", target, "--eagle3", str(fixtures / "speculators"), "--mode", "eagle3",
                 "--max-new-tokens", "16", "--prompt-len", "8", "--out", str(out), "-q"]) == 0
    inputs = json.loads((out / "report.json").read_text())["runs"][0]["programs"][0]["inputs"]
    draft_vocab = json.loads((fixtures / "speculators" / "config.json").read_text())["draft_vocab_size"]
    assert inputs["[1]['d2t']"] == f"int32[{draft_vocab}]"
    assert inputs["[1]['lm_head']['kernel']"].endswith(f", {draft_vocab}]")
    capsys.readouterr()
    assert main(["lower", "--model", target, "--mode", "eagle3", "--max-new-tokens", "16", "--prompt-len", "8",
                 "--out", str(tmp_path / "default"), "-q"]) == 0
    default = json.loads((tmp_path / "default" / "report.json").read_text())["runs"][0]["programs"][0]["inputs"]
    assert "[1]['d2t']" not in default
    capsys.readouterr()
    other = config_file(tmp_path, "other")  # hidden size 64: not the head's target
    assert main(["lower", "--model", str(other), "--eagle3", str(fixtures / "speculators"), "--mode", "eagle3",
                 "--memory-only", "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trained for another target: hidden_size" in err[0]
