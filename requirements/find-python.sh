#!/bin/sh
# Print the path of a Python interpreter of version $1 (for example 3.12), or nothing when there is none:
# python$1 on PATH first, then the versions pyenv holds (a pyenv shim of a version not selected fails to run and
# is passed over). Used by `make test-py312`.
want="$1"
major=${want%%.*}
minor=${want#*.}
check="import sys; sys.exit(sys.version_info[:2] != ($major, $minor))"
root=$( (pyenv root) 2>/dev/null )
for candidate in "$(command -v "python$want" 2>/dev/null)" ${root:+"$root"/versions/"$want"*/bin/python"$want"}; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" -c "$check" 2>/dev/null; then
        echo "$candidate"
        exit 0
    fi
done
