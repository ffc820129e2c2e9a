"""The project installs under one import name: every package of the tree is listed in setup.cfg as a
subpackage of `llm_swarm`, the user-facing classes import from `llm_swarm`, and nothing in the
project imports the folders by their own names (which any module named `client` or `server` on a
user's path would shadow)."""

from __future__ import annotations

import configparser
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("swarm", "client", "server", "scheduler")

pytestmark = pytest.mark.version_neutral  # no transformers code: one leg runs it


def test_every_package_of_the_tree_is_installed_under_llm_swarm():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    tree = {"llm_swarm"} | {
        "llm_swarm." + ".".join(init.parent.relative_to(ROOT).parts)
        for folder in FOLDERS
        for init in (ROOT / folder).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert listed == tree


@pytest.mark.swarm
def test_a_users_script_named_client_imports_the_classes(tmp_path):
    """A script called client.py beside a module called server.py: their names no longer collide."""
    (tmp_path / "server.py").write_text("RAISE = 1 / 0  # a user's own module, never imported by us\n")
    script = tmp_path / "client.py"
    script.write_text(
        "from llm_swarm import AutoDistributedModelForCausalLM, ClientOptions\n"
        "import sys\n"
        "loaded = {name.split('.')[0] for name in sys.modules}\n"
        "assert not {'swarm', 'server', 'scheduler'} & loaded, loaded\n"
        "print(AutoDistributedModelForCausalLM.__module__)\n"
    )
    completed = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.strip() == "llm_swarm.client.model"
