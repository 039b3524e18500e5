"""Adds up the JUnit XML reports of the C++ tests (bazel-testlogs/**/test.xml) and the pytest
runs given after it, and
prints one line: 'N passed, M failed, K skipped'. Exits 1 if anything failed or nothing ran."""
import glob
import os
import sys
import xml.etree.ElementTree as ET


def count(path):
    passed = failed = skipped = 0
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        elif case.find("skipped") is not None or case.get("status") == "notrun":
            skipped += 1
        else:
            passed += 1
    return passed, failed, skipped


def main(testlogs, *pytest_xmls):
    totals = [0, 0, 0]
    reports = glob.glob(os.path.join(testlogs, "**", "test.xml"), recursive=True)
    reports += [x for x in pytest_xmls if os.path.exists(x)]
    for r in reports:
        for i, n in enumerate(count(r)):
            totals[i] += n
    passed, failed, skipped = totals
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], *sys.argv[2:]))
