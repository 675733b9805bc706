"""`shadow demo` on a busy host: N CPU burners beside a headless demo, and whether it stayed honest.

    python bench/demo_burners.py                   # 4 burners, the default 75 s demo
    python bench/demo_burners.py --burners 0       # the same on the host as it is

Honest means one of: the twin held (fidelity < 2 % and step fit R² > 0.9) and the last line is
a verdict with its interval, or the last line says the figures are not trustworthy and why (never
a bare ratio). Prints the figures, the last line and HONEST / NOT HONEST; exits 1 on NOT HONEST.
The burners are busy loops (`python -c 'while True: pass'`), stopped at the end whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--burners", type=int, default=4, help="busy-loop processes beside the demo (default 4)")
    p.add_argument("--duration", type=float, default=75.0, help="the demo's --duration (default 75)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="demo-burners-"))
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    try:
        report = work / "report.json"
        proc = subprocess.run(
            [sys.executable, "-m", "shadow", "demo", "--headless", "--duration", str(args.duration),
             "--report-json", str(report)],
            capture_output=True, text=True, timeout=args.duration + 600,
        )
        load = os.getloadavg()[0]
    finally:
        for b in burners:
            b.terminate()
        for b in burners:
            b.wait(10)
    if proc.returncode != 0:
        print(proc.stderr[-3000:])
        return 1
    doc = json.loads(report.read_text())
    last = [line for line in proc.stdout.splitlines() if line.strip()][-1]
    fid = doc["fidelity"]["load_rel_error"]
    r2 = doc["step_model"]["r2"]
    cmp = doc["comparison"]
    held = fid is not None and fid < 0.02 and r2 is not None and r2 > 0.9
    untrusted_said = last.startswith("figures not trustworthy") and bool(cmp["problems"])
    honest = (held and cmp["trustworthy"] and "95% CI" in last) or (not cmp["trustworthy"] and untrusted_said)
    print(json.dumps({"burners": args.burners, "load_average_1m": load, "fidelity": fid, "r2": r2,
                      "trustworthy": cmp["trustworthy"], "problems": cmp["problems"],
                      "host": doc["demo"]["host"], "requests": doc["demo"]["requests"],
                      "requests_ok": doc["demo"]["requests_ok"]}, indent=1))
    print("last line:", last)
    print("HONEST" if honest else "NOT HONEST")
    return 0 if honest else 1


if __name__ == "__main__":
    sys.exit(main())
