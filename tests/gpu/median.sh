# Sourced by kv.sh and plugin-ab.sh: the median of the numbers on stdin
# (separated by spaces or lines); nothing for no numbers.
median() { tr ' ' '\n' | grep . | sort -g | awk '{ v[NR] = $1 } END { if (NR) print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
