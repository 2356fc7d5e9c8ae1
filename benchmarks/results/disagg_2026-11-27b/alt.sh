#!/bin/bash
for i in 2 3; do
  /tmp/d31/cmp_before.sh $i
  /tmp/d31/cmp.sh after$i
done
