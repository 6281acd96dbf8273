#!/bin/bash
# One task of the training step: srun (slurm/launch.sh) runs this once per rank with the trainer's
# command line as arguments. It runs the trainer and, when the trainer ends with a status that is
# neither 0 (done) nor 75 (checkpointed after a preemption warning: requeue me), prints one line
# naming the rank and ends the whole job step at once.
#
# Why: srun's --kill-on-bad-exit cannot tell 75 apart from a crash, so the step runs without it;
# and a dead peer is no error to the survivors under NCCL but a hang, which their watchdog ends
# only after watchdog_s. With this wrapper a crashed rank (an exception, the OOM killer, a segfault)
# ends all ranks within seconds, and launch.sh exits non-zero without a requeue.
#
# Signals: Slurm's --signal=USR1@... (no B:) and scancel's SIGTERM reach every process of the step,
# this shell too. The traps keep it alive (a trap with a command, unlike an ignored signal, is not
# inherited by the trainer, which handles both); it then waits for the trainer, whose status after
# a SIGTERM (143, checkpointed) is the step ending as Slurm asked, not a crash.
set -u

stopping=""
trap 'stopping=USR1' USR1
trap 'stopping=TERM' TERM

# The trainer writes to the task's stderr (fd 3 here); the shell's own report of a child killed by
# a signal ("line N: PID Killed ...") goes nowhere: the one line below says it, naming the rank.
{ "$@" 2>&3 3>&-; } 3>&2 2>/dev/null
status=$?
if [ "$status" -eq 0 ] || [ "$status" -eq 75 ] || [ "$stopping" = TERM ]; then
  exit "$status"
fi

if [ "$status" -gt 128 ]; then
  how="was killed by signal $((status - 128)) (SIG$(kill -l $((status - 128)) 2>/dev/null || echo '?'))"
else
  how="exited with status $status"
fi
step=${SLURM_JOB_ID:-?}.${SLURM_STEP_ID:-?}
echo "error: rank ${SLURM_PROCID:-?} (node ${SLURMD_NODENAME:-$(hostname)}) $how: ending job step $step" >&2
# SIGKILL at once: SIGTERM would ask each survivor for a checkpoint, which needs a collective with
# the rank that is gone. The last complete checkpoint is what a resubmitted job resumes from.
# scancel runs inside the step, so the kill it asks for may end it (and this shell) first: that is
# success, not a failure to report (nor a line from the shell about a killed child).
if [ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_STEP_ID:-}" ]; then
  { scancel --quiet --signal=KILL "$step" 2>&3 3>&-; } 3>&2 2>/dev/null
  cancelled=$?
  if [ "$cancelled" -ne 0 ] && [ "$cancelled" -le 128 ]; then
    echo "error: scancel $step failed: the other ranks stop at their watchdog (watchdog_s)" >&2
  fi
fi
exit "$status"
