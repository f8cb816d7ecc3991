"""Runs one part of the pytest suite for ctest: `run.py cpu` (tests without the
gpu marker) or `run.py gpu`. Exit 0 when tests passed and none failed, 1 on any
failure or error, 77 with a line "SKIP: reason" when every test of the part
skipped (no GPU: ctest reports the test skipped, not passed)."""
import os
import sys

try:
    import pytest
except ImportError:
    print(f"SKIP: pytest is not installed for {sys.executable} (Debian: apt-get install python3-pytest)")
    sys.exit(77)


class Tally:
    def __init__(self):
        self.passed = self.failed = self.skipped = 0
        self.reason = ""

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failed += 1
        elif report.skipped:
            self.skipped += 1
            if not self.reason and isinstance(report.longrepr, tuple):
                self.reason = report.longrepr[2].removeprefix("Skipped: ")
        elif report.passed and report.when == "call":
            self.passed += 1


def main():
    part = sys.argv[1] if len(sys.argv) > 1 else ""
    if part not in ("cpu", "gpu"):
        sys.exit("usage: run.py cpu|gpu [pytest arguments]")
    here = os.path.dirname(os.path.abspath(__file__))
    tally = Tally()
    rc = pytest.main([here, "-m", "gpu" if part == "gpu" else "not gpu", "-p", "no:cacheprovider",
                      "-q", "-rs", *sys.argv[2:]], plugins=[tally])
    if rc not in (0, 5) or tally.failed:
        sys.exit(1)
    if tally.passed == 0:
        print(f"SKIP: every {part} test of the Python suite skipped: {tally.reason or 'nothing to run'}")
        sys.exit(77)
    sys.exit(0)


if __name__ == "__main__":  # spawned multiprocessing children import this file again
    main()
