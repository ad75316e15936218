"""The GPU check fits one call to a lent machine: its sections' timeouts, each with its kill margin, add up to at most
7 minutes (a call has 10, the machine's start included, and a command killed at the limit returns none of its
files), and every section writes under $OUT."""

import re
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"
LIMIT_S = 7 * 60


def test_the_sections_fit_one_call():
    text = SCRIPT.read_text()
    kill_after = int(re.search(r"^KILL_AFTER=(\d+)", text, re.M).group(1))
    sections = re.findall(r"^section (\w+) (\d+) (.*)$", text, re.M)
    assert len(sections) >= 4
    assert sum(int(seconds) + kill_after for _, seconds, _ in sections) <= LIMIT_S
    for name, _, command in sections:
        assert "--out" not in command or f'"$OUT/{name}"' in command, name
