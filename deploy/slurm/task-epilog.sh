#!/bin/sh
# Slurm TaskEpilog for greend (slurm.conf: TaskEpilog=/etc/slurm/greend-task-epilog.sh, run
# by slurmd as the job's user after each task, while the job still runs).
#
# After an srun step's local task 0 on a node, it waits until greend has ended that run
# (JOBID.STEP, as the callback names it under srun: the step's ranks on this node gone)
# and adds the node's figures to the job's Comment, where Slurm shows them to the user:
#   scontrol show job JOBID    ->  Comment=greend:1234.0@node1:gpu_J=5120.3,GFLOPS/W=41.2,...
#   sacct -j JOBID -o Comment%200   (with slurmdbd and AccountingStoreFlags=job_comment)
# One entry per step and node, separated by ";" (several nodes may write at once: an entry
# can then be lost, never the job; the Epilog's saved reports keep every node's figures).
# The job's own Comment, if any, is kept in front.
#
# The batch script's own task, tasks other than local task 0, and runs greend never saw
# are left alone. It always exits 0 and prints nothing on stdout (a TaskEpilog's stdout
# is not the job's); what went wrong goes to stderr.
#
# Environment: set by slurmd (SLURM_JOB_ID, SLURM_STEP_ID, SLURM_LOCALID); GREENCTL
# (default: greenctl), PYTHON (default: python3), SCONTROL (default: scontrol),
# GREEND_TASK_EPILOG_WAIT_S (default 10).

GREENCTL=${GREENCTL:-greenctl}
PYTHON=${PYTHON:-python3}
SCONTROL=${SCONTROL:-scontrol}
WAIT_S=${GREEND_TASK_EPILOG_WAIT_S:-10}

case "${SLURM_STEP_ID:-}" in
    '' | *[!0-9]*) exit 0 ;; # the batch script, or the extern step: not a training run
esac
[ "${SLURM_LOCALID:-0}" = 0 ] || exit 0
[ -n "${SLURM_JOB_ID:-}" ] || exit 0

RUN="$SLURM_JOB_ID.$SLURM_STEP_ID"
export RUN
waited=0
while :; do
    state=$($GREENCTL report "$RUN" --json 2>/dev/null | "$PYTHON" -c '
import json, sys
try:
    print(json.load(sys.stdin).get("state", ""))
except ValueError:
    print("")
')
    [ "$state" = ended ] && break
    if [ -z "$state" ] && [ "$waited" -ge 2 ]; then
        exit 0 # greend never saw this run (no callback in it, or no greend here)
    fi
    if [ "$waited" -ge "$WAIT_S" ]; then
        echo "greend-task-epilog: run $RUN had not ended after ${WAIT_S} s; its figures so far" >&2
        break
    fi
    sleep 1
    waited=$((waited + 1))
done

host=$(hostname -s 2>/dev/null || hostname)
entry=$($GREENCTL report "$RUN" --json 2>/dev/null | HOST="$host" "$PYTHON" -c '
import json, os, sys
try:
    r = json.load(sys.stdin)
except ValueError:
    sys.exit(0)
def num(v, fmt):
    return format(v, fmt) if isinstance(v, (int, float)) else "-"
saved = (r.get("savings") or {}).get("saved_pct")
run, host = os.environ["RUN"], os.environ["HOST"]
fields = [
    "gpu_J=" + num(r.get("gpu_energy_j"), ".1f"),
    "GFLOPS/W=" + num(r.get("gflops_per_w"), ".4g"),
    "steps=" + str(r.get("steps", 0)),
    "ranks=" + str(r.get("ranks_here", "-")) + "/" + str(r.get("world_size", "-")),
    "saved_pct=" + num(saved, ".1f"),
]
print("greend:" + run + "@" + host + ":" + ",".join(fields))
')
if [ -z "$entry" ]; then
    echo "greend-task-epilog: no report for run $RUN" >&2
    exit 0
fi

# The Comment so far (scontrol's one-line form: the field runs to the next " Key=").
old=$($SCONTROL -o show job "$SLURM_JOB_ID" 2>/dev/null | "$PYTHON" -c '
import re, sys
m = re.search(r"(?:^| )Comment=(.*?)(?= [A-Za-z]+=|$)", sys.stdin.read().strip())
v = m.group(1) if m else ""
print("" if v == "(null)" else v)
')
comment=${old:+$old;}$entry
if ! $SCONTROL update JobId="$SLURM_JOB_ID" Comment="$comment" >/dev/null 2>&1; then
    echo "greend-task-epilog: could not set the Comment of job $SLURM_JOB_ID" >&2
fi
exit 0
