# renice the serving parts (not the decode worker) as soon as they appear
N=${1:-10}
for i in $(seq 1 80); do
  for p in $(pgrep -f "services.cli (processor|frontend|router)"); do renice -n $N -p $p >/dev/null 2>&1; done
  sleep 0.5
done
