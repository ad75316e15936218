"""Eval JSONL loading: both record formats, keys by line and content, bad lines reported with their numbers."""

import json

import pytest

from parse_jax.errors import InputError
from parse_jax.harness.eval.data import load_records, write_task_jsonl
from parse_jax.tasks import load_task

TASK = load_task()


def _write(tmp_path, lines, name="data.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


GOOD_GSM = json.dumps({"question": "How many?", "answer": "2 + 3 = 5\n#### 5"})
GOOD_TASK = json.dumps({"prompt": "( 3 + 4 ) * ( 5 - 2 ) :",
                        "solution": "3 + 4 = 7 ; 5 - 2 = 3 ; 7 * 3 = 1 ; answer 1"})


def test_both_formats_load_with_keys(tmp_path):
    p = _write(tmp_path, [GOOD_GSM, GOOD_TASK, json.dumps({"prompt": "( 1 + 1 ) :", "id": 7})])
    recs, bad = load_records(p, TASK)
    assert bad == [] and [r.line for r in recs] == [1, 2, 3]
    assert [(r.kind, r.reference) for r in recs] == [("gsm8k", "5"), ("task", "1"), ("task", "2")]
    assert len({r.key for r in recs}) == 3 and recs[0].key.startswith("1:")
    again, _ = load_records(_write(tmp_path, [GOOD_GSM, json.dumps({"question": "Other?", "answer": "#### 5"})],
                                   "b.jsonl"), TASK)
    assert again[0].key == recs[0].key and again[1].key != recs[1].key  # same line + content = same key


BAD = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ("", "empty line"),
    (json.dumps({"question": "Q?"}), "'answer' string"),
    (json.dumps({"question": "Q?", "answer": "5"}), "no final answer"),
    (json.dumps({"question": "", "answer": "#### 5"}), "non-empty"),
    (json.dumps({"prompt": "hello world"}), "not a problem of task"),
    (json.dumps({"text": "x"}), "unknown record format"),
]


@pytest.mark.parametrize("line, reason", BAD)
def test_bad_lines_are_named_with_their_numbers(tmp_path, line, reason):
    p = _write(tmp_path, [GOOD_GSM, line, GOOD_TASK])
    with pytest.raises(InputError, match=rf"1 bad line\(s\): line 2: .*{reason}"):
        load_records(p, TASK)
    recs, bad = load_records(p, TASK, on_bad_line="skip")
    assert [r.line for r in recs] == [1, 3]
    assert [b.line for b in bad] == [2] and reason in bad[0].reason


def test_many_bad_lines_all_reported(tmp_path):
    p = _write(tmp_path, ["{"] * 12 + [GOOD_GSM])
    with pytest.raises(InputError, match=r"12 bad line\(s\): line 1: .* and 2 more"):
        load_records(p, TASK)


def test_unreadable_or_empty_data(tmp_path):
    with pytest.raises(InputError, match="cannot read data file"):
        load_records(tmp_path / "missing.jsonl", TASK)
    with pytest.raises(InputError, match="no valid record"):
        load_records(_write(tmp_path, ["{"]), TASK, on_bad_line="skip")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\n")
    with pytest.raises(InputError, match="not UTF-8"):
        load_records(tmp_path / "bin.jsonl", TASK)


def test_task_records_round_trip(tmp_path):
    p = write_task_jsonl(TASK, 5, tmp_path / "t.jsonl", seed=3)
    recs, _ = load_records(p, TASK)
    probs = TASK.problems(5, 3)
    assert [r.prompt for r in recs] == [q for q, _ in probs]
    assert [r.reference for r in recs] == [TASK.answer(q) for q, _ in probs]


def test_a_limit_reads_only_up_to_its_last_record(tmp_path):
    """lm-eval's --limit: the first N records; a bad line past the N-th is not read (no error, not reported), one
    before it is."""
    p = _write(tmp_path, [GOOD_GSM, "{", GOOD_TASK, GOOD_GSM.replace("How", "Who"), "{"])
    recs, bad = load_records(p, TASK, on_bad_line="skip", limit=2)
    assert [r.line for r in recs] == [1, 3] and [b.line for b in bad] == [2]
    with pytest.raises(InputError, match=r"1 bad line\(s\): line 2"):
        load_records(p, TASK, limit=2)
    recs, bad = load_records(_write(tmp_path, [GOOD_GSM, GOOD_TASK, "{"], "b.jsonl"), TASK, limit=2)
    assert [r.line for r in recs] == [1, 2] and bad == []
    from parse_jax.harness.eval.evaluate import as_records

    assert [r.line for r in as_records(tmp_path / "b.jsonl", TASK, limit=1)] == [1]
    with pytest.raises(InputError, match="limit must be >= 1, got 0"):
        as_records(tmp_path / "b.jsonl", TASK, limit=0)
