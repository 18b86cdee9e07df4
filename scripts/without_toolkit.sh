# Sourced by the test scripts: without_toolkit PATHLIST prints PATHLIST without the CUDA toolkit's folders (any folder
# named cuda, any holding an nvcc, a wrapper's included): what a machine without the toolkit has on its search paths.
without_toolkit() {
    local dir kept=()
    IFS=: read -ra dirs <<<"$1"
    for dir in "${dirs[@]}"; do [[ "${dir,,}" == *cuda* || -e "$dir/nvcc" ]] || kept+=("$dir"); done
    (IFS=:; echo "${kept[*]}")
}
