set -e
eval "$(bash .gpu/setup.sh)"
xz -dc .gpu/bench/dspec.xz > /tmp/dspec && chmod +x /tmp/dspec
M=/tmp/models
[ -d $M/qwen15 ] || python3 scripts/random_weights.py .gpu/bench/qwen15 $M/qwen15 --seed 0 >/dev/null
[ -d $M/qwen05 ] || python3 scripts/random_weights.py .gpu/bench/qwen05 $M/qwen05 --seed 1 >/dev/null
summ() { python3 -c "
import json,sys
d=json.load(open(sys.argv[1]))
rows=d['rows']
print(sys.argv[2], 'plain', [round(r['plain']['decode_tokens_per_second'],1) for r in rows], 'spec', [round(r['speculative']['decode_tokens_per_second'],1) for r in rows], 'tau', d.get('tau'), 'diff', [r['first_difference'] for r in rows])
" "$@"; }
for i in 1 2; do for a in on off; do
  /tmp/dspec bench --target $M/qwen15 --drafter model:$M/qwen15 --max-draft 4 --max-tokens 128 --draft-ahead $a --json > $OUT/twin-$a-$i.json 2>>$OUT/err.log && summ $OUT/twin-$a-$i.json "twin $a" || tail -3 $OUT/err.log
done; done
for a in on off; do
  /tmp/dspec bench --target $M/qwen15 --drafter model:$M/qwen05 --max-draft 4 --max-tokens 128 --draft-ahead $a --json > $OUT/small-$a.json 2>>$OUT/err.log && summ $OUT/small-$a.json "small $a" || tail -3 $OUT/err.log
done
