"""The README's tables against the code: every AllToAll parameter, and every PYHIPA2A_* variable that the
package, its scripts and its tests read, has its row, and no row names one that is gone."""
import inspect
import pathlib
import re

from pyhipa2a import AllToAll
from pyhipa2a.api import PARAMETERS

ROOT = pathlib.Path(__file__).resolve().parent.parent


def first_column_names(section: str) -> set:
    """The `backticked` names in the first column of the table under the README's `## section`."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return {name for line in body.splitlines() if line.startswith("| `")
            for name in re.findall(r"`([^`]+)`", line.split("|")[1])}


def test_every_parameter_has_a_row():
    face = {name for name, p in inspect.signature(AllToAll.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert first_column_names("Parameters") == PARAMETERS | face


def test_every_environment_variable_has_a_row():
    read = set()
    for folder in ("pyhipa2a", "scripts", "tests"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh"):
                read.update(re.findall(r"PYHIPA2A_[A-Z0-9_]+", path.read_text()))
    assert first_column_names("Environment") == read
