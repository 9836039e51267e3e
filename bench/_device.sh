# Sourced by the bench/h200*.sh scripts, which run on the device machine from
# the repo root with .dev carried (bench/h200.sh says how). It sets $out (the
# device's $OUT), $site (Ray and NIXL unpacked from .dev), tree_of CHECKOUT
# (prints a fresh import tree of that checkout's layers), $tree (this
# checkout's), PYTHONPATH, and kvh: the kvhandoff command of the tree first
# on PYTHONPATH (in a tree from before cli/ left actors/, kvhandoff.actors.cli).
out=${OUT:-out}; mkdir -p "$out"
site=$(mktemp -d); for f in .dev/*.txz; do tar xJf "$f" -C "$site"; done
tree_of() {
  local t; t=$(mktemp -d); mkdir -p "$t/kvhandoff"
  ln -s "$1/pkg/__init__.py" "$t/kvhandoff/__init__.py"
  for layer in protocol topology actors cli integrations tools; do
    if [ -e "$1/$layer" ]; then ln -s "$1/$layer" "$t/kvhandoff/$layer"; fi
  done
  echo "$t"
}
tree=$(tree_of "$PWD")
export PYTHONPATH=$tree:$site:$PWD NIXL_LOG_LEVEL=WARN RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
kvh_cmd=(python -c "import importlib.util, sys; m = importlib.import_module('kvhandoff.cli' if importlib.util.find_spec('kvhandoff.cli') else 'kvhandoff.actors.cli'); sys.exit(m.main(sys.argv[1:]))")
kvh() { "${kvh_cmd[@]}" "$@"; }  # under `timeout`: timeout N "${kvh_cmd[@]}" ...
