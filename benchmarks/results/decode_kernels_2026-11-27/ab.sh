#!/bin/bash
# alternate old (HEAD worktree) and new (working tree) engine decode at 32 sequences
for rep in 1 2 3; do
 for c in 32 480; do
  for v in old new; do
   d=/work/main; [ $v = old ] && d=/tmp/oldwt
   r=$(cd $d && /work/main/.venv/bin/python -m services.cli bench engine --threads 2 --concurrency 32 --decode-steps 96 --decode-context $c --json /tmp/served/ab_${v}_${c}_${rep}.json 2>&1 | tail -1 | awk '{print $5}' | tr '\n' ' ')
   echo "rep $rep ctx $c $v: $r load $(cut -d' ' -f1 /proc/loadavg)"
  done
 done
done
