for i in $(seq 1 60); do P=$(pgrep -f "services.cli processor" | head -1); F=$(pgrep -f "services.cli frontend" | head -1); [ -n "$P" ] && [ -n "$F" ] && break; sleep 0.5; done
sleep 17
/work/main/.venv/bin/py-spy record -p $P -d 7 -r 200 -f raw -o /tmp/sr/spy_proc.raw --nonblocking > /tmp/sr/spy_proc.log 2>&1 &
/work/main/.venv/bin/py-spy record -p $F -d 7 -r 200 -f raw -o /tmp/sr/spy_front.raw --nonblocking > /tmp/sr/spy_front.log 2>&1 &
wait
