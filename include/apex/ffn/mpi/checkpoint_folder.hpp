#pragma once
/// \file mpi/checkpoint_folder.hpp
/// The two checks that keep a sharded save (mpi/expert_parallel_checkpoint.hpp) from
/// committing an index whose shards are not where the index says.
///
/// **One folder.** Every rank writes its shard into the folder it was
/// given, and rank 0 writes the index into its own: if rank 1 was given
/// another folder, the index names a shard that is not beside it, and the
/// previous checkpoint's shards are deleted — a good checkpoint destroyed by
/// a save that returned normally. Comparing the paths cannot decide it: the
/// same shared folder may be mounted under different paths on different
/// hosts (equal folders, different strings), and a node-local `/tmp/ckpt`
/// has the same string on every host (different folders, equal strings).
/// So rank 0 writes a token file `.apex-save-<tag>.token` holding the
/// save's tag into its folder, every rank reads it back from its own, and
/// the ranks agree: a rank that cannot read it, or reads another tag, is
/// not in rank 0's folder, and every rank throws the same FormatError
/// before any shard is written. Then rank 0 removes the token. This needs
/// close-to-open consistency (a file closed on one host can be opened on
/// another), which NFS and parallel file systems give.
///
/// **Every shard there.** Before it writes the index, rank 0 checks that
/// every shard the index will name exists in its folder with the size its
/// writer reported (`check_shards`), so an index is only ever committed
/// over shards rank 0 can see.

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "../core/errors.hpp"
#include "communicator.hpp"

namespace apex::mpi::detail {

/// Rank 0's `text` on every rank (collective).
inline std::string broadcast_text(const Communicator& comm, const std::string& text) {
  int len = comm.rank() == 0 ? int(text.size()) : 0;
  check(MPI_Bcast(&len, 1, MPI_INT, 0, comm.get()), "MPI_Bcast (checkpoint)");
  std::string out = comm.rank() == 0 ? text : std::string(std::size_t(len), '\0');
  if (len > 0) check(MPI_Bcast(out.data(), len, MPI_CHAR, 0, comm.get()), "MPI_Bcast (checkpoint)");
  return out;
}

/// The first 255 bytes of the file at `path`, or "" if it cannot be read.
inline std::string read_token(const std::filesystem::path& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return {};
  char buf[256];
  const std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  return std::string(buf, n);
}

/// Throws the same FormatError on every rank unless every rank's `folder`
/// is rank 0's (see the file comment). Collective; `tag` is the save's, the
/// same on every rank. Leaves no token behind.
inline void agree_on_folder(const Communicator& comm, const char* where, const std::string& folder,
                            const std::string& tag) {
  const std::filesystem::path token = std::filesystem::path(folder) / (".apex-save-" + tag + ".token");
  const std::string origin = broadcast_text(comm, folder);
  bool wrote = false;
  try {
    comm.step(where, [&] {
      if (comm.rank() != 0) return;
      std::FILE* f = std::fopen(token.c_str(), "wb");
      wrote = f != nullptr;
      const bool ok = f && std::fputs(tag.c_str(), f) >= 0;
      if (!f || std::fclose(f) != 0 || !ok)
        throw FormatError(std::string(where) + ": cannot write '" + token.string() + "' (does folder '" + folder +
                          "' exist and is it writable?)");
    });
    comm.step(where, [&] {
      if (read_token(token) != tag)
        throw FormatError(std::string(where) + ": rank " + std::to_string(comm.rank()) + "'s folder '" + folder +
                          "' is not rank 0's folder '" + origin + "' (it does not hold the token " +
                          token.filename().string() + " rank 0 wrote there); every rank must pass the same folder, "
                          "on one file system every rank sees");
    });
  } catch (...) {
    if (wrote) ::unlink(token.c_str());
    throw;
  }
  if (wrote) ::unlink(token.c_str());
}

/// FormatError unless every (file, size) of `shards` is a regular file of
/// that many bytes in `folder`.
inline void check_shards(const char* where, const std::filesystem::path& folder,
                         const std::vector<std::pair<std::string, std::uint64_t>>& shards) {
  namespace fs = std::filesystem;
  for (const auto& [file, size] : shards) {
    std::error_code ec;
    const fs::path path = folder / file;
    if (!fs::is_regular_file(path, ec))
      throw FormatError(std::string(where) + ": shard '" + path.string() +
                        "' does not exist as a regular file in rank 0's folder; the index was not written");
    const std::uintmax_t bytes = fs::file_size(path, ec);
    if (ec || bytes != size)
      throw FormatError(std::string(where) + ": shard '" + path.string() + "' has " + std::to_string(bytes) +
                        " bytes, expected " + std::to_string(size) + "; the index was not written");
  }
}

}  // namespace apex::mpi::detail
