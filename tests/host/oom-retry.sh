#!/bin/bash
# Checks scripts/guest/oom-retry, the rule by which scripts/test runs a failed guest boot's
# scenarios once more: only a failure whose one cause is the OOM killer taking a hog.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
rule=$ROOT/scripts/guest/oom-retry
d=$(mktemp -d); trap 'rm -rf "$d"' EXIT
cat > "$d/base.log" <<'LOG'
  10.0 UZRAM-E2E [9.0s] --- scenario b_swap
  40.0 SCENARIO b_swap PASS (30s)
  41.0 UZRAM-E2E [40.0s] --- scenario r_recover
  50.0 [   49.1] Out of memory: Killed process 3460 (hog) total-vm:1000kB, anon-rss:0kB
  55.0 crashkill: pswpin stood still at +42891 of 56832 for 120 s (the load ended?): pid 3461 not killed
  55.1 UZRAM-E2E [54.0s]   FAIL: kill during verification: crashkill/uzram recover rc=3
  55.2 UZRAM-E2E [54.1s]   FAIL: kill during verification: the new daemon's serving line never came
  60.0 UZRAM-E2E [59.0s]   FAIL: hog rc=137
  60.1 UZRAM-E2E [59.0s]   FAIL: hog reported bad words
  61.0 SCENARIO r_recover FAIL (20s)
  62.0 UZRAM-E2E [61.0s] --- scenario s_crash_safe_default
  70.0 SCENARIO s_crash_safe_default PASS (3s)
LOG
fails=0
# expect WANT-OUTPUT WANT-RC SCENARIOS SED-EDIT WHY: the rule on $BASE.log so edited
BASE=base
expect() {
  sed "$4" "$d/$BASE.log" > "$d/t.log"
  out=$("$rule" "$d/t.log" "$3" 2>/dev/null); rc=$?
  if [ "$out" = "$1" ] && [ "$rc" = "$2" ]; then echo "ok: $5"
  else echo "FAIL: $5: printed '$out' rc $rc, want '$1' rc $2"; fails=$((fails + 1)); fi
}
expect r 0 b,r,s '' "a hog taken by the OOM killer is retried"
expect r 0 b,r,s '/FAIL: hog reported bad words/a\  60.2 UZRAM-E2E [59.1s]   FAIL: only 0 MiB swapped out; no real memory pressure' "a hog killed before it pushed out its swap is retried"
expect '' 1 b,r,s '/FAIL: hog reported bad words/a\  60.2 UZRAM-E2E [59.1s]   FAIL: only 0 MiB swapped out; the device refused' "another swap check is not"
expect '' 1 b,r,s,t '' "a scenario without a result line (a hang) is not"
expect '' 1 b,r,s 's/(hog)/(uzram)/' "the OOM killer taking another process is not"
expect '' 1 b,r,s 's/FAIL: hog rc=137/hog: verified 5 words, 12 bad words in 1 bad pages/' "a bad word is not"
expect '' 1 b,r,s 's/s_crash_safe_default PASS/s_crash_safe_default FAIL/' "a second failure without an OOM kill is not"
expect '' 1 b,r,s 's/r_recover FAIL/r_recover PASS/' "a boot with no failed scenario is not"
expect '' 1 b,r,s '5a\  55.0 [   54.0] blk_update_request: I/O error, dev ublkb0, sector 8' "a kernel I/O error is not"
expect '' 1 b,r,s '5a\  55.0 [   54.0] I/O error, dev ublkb0, sector 2048 op 0x0:(READ) flags 0x800' "the kernel's I/O error line as 6.12 and 7.3 print it is not"
expect r 0 b,r,s '5a\  55.0 UZRAM-E2E [54.0s]   ok: no I/O error for the device in the kernel log' "a check that found no I/O error does not stop the retry"
expect '' 1 b,r,s '4d' "a failure without the OOM killer's line is not"
expect '' 1 b,r,s 's/rc=137$/rc=1/' "a hog's other exit status is not"
expect '' 1 b,r,s 's/recover rc=3/recover rc=1/' "a recovery that failed is not"
expect '' 1 b,r,s '/recover rc=3/d' "a new daemon that never served after a kill is not"
expect '' 1 b,r,s '5a\  54.5 UZRAM-E2E [53.0s]   FAIL: kill during verification: the hog is gone' "any other failed check is not"
# the systemd test's log (scripts/guest/check-systemd): one scenario, f_systemd, whose hogs
# have names
cat > "$d/sysd.log" <<'LOG'
  10.0 UZRAM-E2E [9.0s] --- scenario f_systemd
  50.0 [   49.1] Out of memory: Killed process 3460 (hog) total-vm:1000kB, anon-rss:0kB
  60.0 UZRAM-E2E [59.0s]   hog L ran 37.66s (rc 137, limit 300 s)
  60.1 UZRAM-E2E [59.0s]   FAIL: hog L rc=137 across the restart
  90.0 SCENARIO f_systemd FAIL (80s)
LOG
BASE=sysd
expect f 0 f '' "the systemd test's hog L taken by the OOM killer is retried"
expect '' 1 f 's/rc=137 across/rc=1 across/' "its hog L's other exit status is not"
expect '' 1 f '3a\  59.0 UZRAM-E2E [58.0s]   FAIL: after the restart under load: swap on '"''"', MainPID 0 (was 974)' "a restart that failed beside it is not"
expect '' 1 f '2d' "hog L's failure without the OOM killer's line is not"
expect '' 1 f '$d' "a systemd test that never finished (no result line) is not"
[ $fails = 0 ]
