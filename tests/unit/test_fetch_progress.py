"""Which pip reports download progress itself (``--progress-bar raw``, pip 24.1+), and which gets the project's."""

from __future__ import annotations

from selfspec.modeling.realmodels import parse_pip_version, pip_reports_progress


def test_pip_versions_and_which_of_them_report_raw_progress() -> None:
    stock = parse_pip_version("pip 23.2.1 from /usr/lib/python3.11/site-packages/pip (python 3.11)\n")
    assert stock == (23, 2) and not pip_reports_progress(stock)  # Python 3.11's ensurepip: no --progress-bar raw
    assert not pip_reports_progress(parse_pip_version("pip 24.0 from /x (python 3.12)"))
    assert pip_reports_progress(parse_pip_version("pip 24.1 from /x (python 3.12)"))
    assert pip_reports_progress(parse_pip_version("pip 26.3 from /x (python 3.13)"))
    assert parse_pip_version("/usr/bin/python: No module named pip") is None
    assert not pip_reports_progress(None)  # a pip that cannot say: the project draws the progress
