# Sourced by the bench shell scripts from the repository root: PY is $PYTHON, else .venv/bin/python if there is
# one, else python3.
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    PY=$(command -v python3 || command -v python)
fi
