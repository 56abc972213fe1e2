// MPI around the Catch2 session: the prebuilt Catch2WithMain owns main(), so
// MPI is initialised by a static object before main runs and finalised after
// main returns. Every rank runs every test case; the test cases call the
// collectives in the same order on every rank.
#include <mpi.h>

#include <cstdio>
#include <cstdlib>

namespace {

struct MpiSession {
  MpiSession() {
    int provided = 0;
    // Funneled: OpenMP worker threads never call MPI.
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
      std::fprintf(stderr, "MPI_Init_thread failed\n");
      std::abort();
    }
  }
  ~MpiSession() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
};

const MpiSession session;

}  // namespace
