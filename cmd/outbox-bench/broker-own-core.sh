#!/usr/bin/env bash
# Runs outbox-bench with the local RabbitMQ on a CPU of its own, and the
# databases and the bench on the others, as when the broker and the database
# run on different hosts. On a small machine where all three share the cores,
# the database and the relay take CPU from the broker's one busy core, and
# relay_vs_raw then measures that contention more than the relay. The raw
# client runs under the same pinning, so each ratio still compares like with
# like.
#
#	bash cmd/outbox-bench/broker-own-core.sh -scenario relay
#
# Every argument goes to outbox-bench. The CPU affinity of beam.smp,
# postgres and mariadbd/mysqld (every thread) is changed for the run and set
# back on exit, also on error or interrupt. Linux only; needs taskset
# (util-linux), at least two CPUs, and permission to change those processes
# (their owner, or root).
set -euo pipefail

cpus=$(nproc --all)
if ((cpus < 2)); then
	echo "broker-own-core: needs at least two CPUs, this machine has $cpus" >&2
	exit 2
fi
command -v taskset >/dev/null || { echo "broker-own-core: taskset (util-linux) not found" >&2; exit 2; }

broker_cpu=$((cpus - 1))
others=0
((broker_cpu == 1)) || others="0-$((broker_cpu - 1))"

beam=$(pgrep -f beam.smp || true)
if [[ -z $beam ]]; then
	echo "broker-own-core: no local RabbitMQ (beam.smp) to pin" >&2
	exit 2
fi
postgres=$(pgrep -x postgres || true)
mariadb=$(pgrep -x 'mariadbd|mysqld' || true)

# mask is the affinity of a process's main thread, as taskset prints it.
mask() { taskset -p "$1" | awk '{print $NF}'; }
beam_mask=$(mask "$(pgrep -o -f beam.smp)")
[[ -z $postgres ]] || postgres_mask=$(mask "$(pgrep -o -x postgres)") # the postmaster
[[ -z $mariadb ]] || mariadb_mask=$(mask "$(pgrep -o -x 'mariadbd|mysqld')")

# pin sets every thread of each pid to a CPU list.
pin() {
	local list=$1 pid
	shift
	for pid in "$@"; do
		taskset -a -p -c "$list" "$pid" >/dev/null
	done
}

# restore gives each process its kind's mask from before the run, also
# those started meanwhile (PostgreSQL backends inherit the pinning). Ones
# that ended are skipped.
restore() {
	local pid
	for pid in $(pgrep -f beam.smp); do
		taskset -a -p "$beam_mask" "$pid" >/dev/null 2>&1 || true
	done
	for pid in $(if [[ -n ${postgres_mask:-} ]]; then pgrep -x postgres; fi); do
		taskset -a -p "$postgres_mask" "$pid" >/dev/null 2>&1 || true
	done
	for pid in $(if [[ -n ${mariadb_mask:-} ]]; then pgrep -x 'mariadbd|mysqld'; fi); do
		taskset -a -p "$mariadb_mask" "$pid" >/dev/null 2>&1 || true
	done
}
trap restore EXIT

bin="${TMPDIR:-/tmp}/outbox-bench-own-core"
(cd "$(dirname "$0")/../.." && go build -o "$bin" ./cmd/outbox-bench)

# shellcheck disable=SC2086 # pid lists split on purpose
pin "$broker_cpu" $beam
# shellcheck disable=SC2086
pin "$others" $postgres $mariadb
echo "broker-own-core: RabbitMQ on CPU $broker_cpu; databases and the bench on CPUs $others" >&2

# In the background, so that a signal reaches this shell at once: it stops
# the bench (which drops its schema and queue on interrupt), waits for it,
# and exits, which restores.
taskset -c "$others" "$bin" "$@" &
bench=$!
trap 'kill -INT "$bench" 2>/dev/null; wait "$bench"; exit 130' INT TERM HUP
wait "$bench"
