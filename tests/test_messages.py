"""Mistakes with `llmflow plan --try` end in one line that names the value, says what would be taken, and leaves
nothing written."""

from __future__ import annotations

from flows.cli import main


def test_plan_try_refuses_a_batch_no_layout_splits_before_preparing_anything(tmp_path, capsys):
    # Three devices leave dp=3 alone (tp=3 and pp=3 do not divide the tiny model), and 3 x 8 does not divide 8.
    sets = [f"data.output_dir={tmp_path / 'data'}", f"train.output_dir={tmp_path / 'train'}"]
    argv = ["plan", "--try", "2", "--devices", "3", "--device-kind", "cpu", *(a for s in sets for a in ("--set", s))]
    assert main(argv) == 1
    said = capsys.readouterr().err
    assert said == (
        "llmflow plan: no layout that fits keeps the global batch of 8 sequences: a pass of dp x "
        "train.micro_batch_size=8 x parallel.micro_batches=1 takes 24 under dp=3, and 8 is not a multiple of it; "
        "train.grad_accum_steps=3 (a global batch of 24) would split, or try other --devices\n"
    )
    assert list(tmp_path.iterdir()) == []  # no data prepared, no trial directory

