#!/bin/sh
# Slurm Epilog for greend (slurm.conf: Epilog=/etc/slurm/epilog.d/greend.sh, run as root by
# slurmd on every node of a job once it ends).
#
# For each of the job's runs greend saw on this node (the job id, or JOBID.STEP under srun),
# it waits until greend has ended the run (its ranks disconnected: the caps greend set for it
# are already restored then) and saves this node's report as JSON:
#   $GREEND_REPORT_DIR/<run>.<host>.json   (default /var/log/greend)
# Those files from all nodes, or the nodes' SQLite stores, give the whole job:
#   greenctl report JOBID.0 --store node1.db --store node2.db
#
# Only the runs of the job's owner (SLURM_JOB_UID, set by slurmd) are waited for and saved:
# a run another uid registered under this job's id (greend refuses that where scontrol is on
# its PATH; see greend/jobs/slurm.py) is named in the log and left alone.
#
# It always exits 0: an Epilog that fails drains the node. What went wrong goes to syslog
# (logger -t greend-epilog) or to stderr.
#
# Environment: SLURM_JOB_ID and SLURM_JOB_UID (set by slurmd); GREENCTL (default: greenctl),
# PYTHON (default: python3), GREEND_REPORT_DIR, GREEND_EPILOG_WAIT_S (default 15).

GREENCTL=${GREENCTL:-greenctl}
PYTHON=${PYTHON:-python3}
REPORT_DIR=${GREEND_REPORT_DIR:-/var/log/greend}
WAIT_S=${GREEND_EPILOG_WAIT_S:-15}

say() {
    if command -v logger >/dev/null 2>&1; then logger -t greend-epilog -- "$*"; fi
    echo "greend-epilog: $*" >&2
}

if [ -z "${SLURM_JOB_ID:-}" ]; then
    say "SLURM_JOB_ID is not set: run me as slurm.conf's Epilog"
    exit 0
fi

# The job owner's runs: "<state> <id>" lines from greenctl jobs --json (with "others", the
# runs of other uids under the job's id, as "<uid> <id>").
runs() {
    $GREENCTL jobs --json 2>/dev/null | "$PYTHON" -c '
import json, os, sys
job = os.environ["SLURM_JOB_ID"]
owner = os.environ.get("SLURM_JOB_UID", "")
try:
    jobs = json.load(sys.stdin)["jobs"]
except ValueError:
    sys.exit(0)
for j in jobs:
    if j["job"] == job or j["job"].startswith(job + "."):
        theirs = owner.isdigit() and j.get("uid") is not None and j["uid"] != int(owner)
        if theirs == (sys.argv[1:] == ["others"]):
            print(j["uid"] if theirs else j["state"], j["job"])
' "$@"
}

if ! $GREENCTL status >/dev/null 2>&1; then
    say "job $SLURM_JOB_ID: greend is not reachable; nothing saved (its caps are restored when it stops: greend restore)"
    exit 0
fi

if [ -z "${SLURM_JOB_UID:-}" ]; then
    say "job $SLURM_JOB_ID: SLURM_JOB_UID is not set: every run under the job's id is saved"
fi
runs others | while read -r uid run; do
    say "job $SLURM_JOB_ID: run $run is uid $uid's, not the job owner's (uid $SLURM_JOB_UID): not saved"
done

waited=0
while runs | grep -qv '^ended '; do
    if [ "$waited" -ge "$WAIT_S" ]; then
        say "job $SLURM_JOB_ID: a run had not ended after ${WAIT_S} s; saving it as it is"
        break
    fi
    sleep 1
    waited=$((waited + 1))
done

host=$(hostname -s 2>/dev/null || hostname)
mkdir -p "$REPORT_DIR" 2>/dev/null
runs | while read -r state run; do
    out="$REPORT_DIR/$(echo "$run" | tr '/' '_').$host.json"
    if $GREENCTL report "$run" --json >"$out.tmp" 2>/dev/null && mv "$out.tmp" "$out"; then
        say "job $SLURM_JOB_ID: run $run ($state) saved to $out"
    else
        rm -f "$out.tmp"
        say "job $SLURM_JOB_ID: could not save the report of run $run to $out"
    fi
done
exit 0
