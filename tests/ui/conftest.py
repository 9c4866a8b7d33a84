"""The chat page in Debian's headless Chromium, driven by Playwright (pytest-playwright fixtures).

Playwright's own browser download needs the internet, so the tests use /usr/bin/chromium and
install it (with a font: Chromium aborts when it has none) where it is missing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from mmserve.testing.reference import png_bytes, synthetic_image

CHROMIUM = Path("/usr/bin/chromium")
FONTS = Path("/usr/share/fonts")
SCREENSHOTS = Path(__file__).parent / "screenshots"


def _apt_get(*args: str) -> subprocess.CompletedProcess:
    env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    return subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True)


def _install(packages: list[str]) -> None:
    if shutil.which("apt-get") is None:
        pytest.fail(f"the UI tests need {packages} and apt-get is not there to install them")
    install = ("install", "-y", *packages)
    if _apt_get(*install).returncode != 0:
        _apt_get("update")  # a clean machine has no package lists yet
        result = _apt_get(*install)
        if result.returncode != 0:
            pytest.fail(f"apt-get install {' '.join(packages)} failed:\n{result.stderr[-2000:]}")


@pytest.fixture(scope="session")
def chromium_executable() -> Path:
    missing = [] if CHROMIUM.exists() else ["chromium"]
    if not any(FONTS.rglob("*.[ot]tf")):
        missing.append("fonts-dejavu-core")
    if missing:
        _install(missing)
    return CHROMIUM


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args, chromium_executable) -> dict:
    return {
        **browser_type_launch_args,
        "executable_path": str(chromium_executable),
        "args": [
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--disable-quic",
        ],
    }


@pytest.fixture(scope="session")
def browser_context_args(browser_context_args) -> dict:
    return {**browser_context_args, "viewport": {"width": 1280, "height": 800}}


@pytest.fixture(scope="session")
def image_paths(tmp_path_factory) -> list[Path]:
    """Two small distinct PNGs."""
    folder = tmp_path_factory.mktemp("images")
    paths = []
    for seed in (1, 2):
        path = folder / f"picture-{seed}.png"
        path.write_bytes(png_bytes(synthetic_image(224, 168, seed=seed)))
        paths.append(path)
    return paths


@pytest.fixture(scope="session")
def screenshot_dir() -> Path:
    SCREENSHOTS.mkdir(exist_ok=True)
    return SCREENSHOTS
