// Must NOT compile (ctest structure.missing_tiles, tests/CMakeLists.txt):
// a weight type's tiles asked for on a path the table has none for is the
// static_assert of kernels/weight_types.hpp (TilesOn) naming the type and
// the path, never another type's code. f32 has tiles on avx2 and avx512
// and none on avx512_vnni (that path runs its avx512 tiles), so it stands
// for a new type whose tiles on one path were forgotten.
#include <apex/ffn/kernels/fused_expert.hpp>

using apex::packed::Dtype;
using apex::packed::Isa;
using apex::packed::detail::TilesOn;

static_assert(TilesOn<Dtype::f32, Isa::avx512>::check());       // defined: compiles
static_assert(TilesOn<Dtype::f32, Isa::avx512_vnni>::check());  // missing: the error the test expects

int main() { return 0; }
