# Sourced by the device scripts (from the repository root): the carried wheels installed into
# /tmp/site, the packages' sources on PYTHONPATH (absolute: benchmarks start launches in other
# folders), `stamp MESSAGE` printing the seconds since sourcing, and OUT required.
out=${OUT:?"OUT must name the folder whose files come back (the device tool sets it)"}
start=$SECONDS
stamp() { echo "[$((SECONDS - start)) s] $*"; }

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    { echo "installing the carried wheels failed" >&2; exit 2; }
fi
PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | tr '\n' ':')${PYTHONPATH:-}
export PYTHONPATH PYTHONUNBUFFERED=1
