#!/bin/bash
for rep in 1 2; do
 for v in old new; do
   d=/work/main; [ $v = old ] && d=/tmp/oldwt
   r=$(cd $d && /work/main/.venv/bin/python -m services.cli bench anchor --phases served --threads 2 --itl-prompt 16 --itl-out 128 --itl-requests 2 --streams 32 --stream-requests 64 --json /tmp/served/served_${v}_${rep}.json 2>&1 | grep "tandem served:")
   echo "rep $rep $v: $r load $(cut -d' ' -f1 /proc/loadavg)"
 done
done
