#!/usr/bin/env bash
# A static OpenSSL 3.5 for the bulk plane's native TLS (hybridfleet.ps.wire._tls), built from
# Debian trixie's source package (apt checks it against the archive's signed index) into
# $HFLEET_OPENSSL_PREFIX (default /opt/hybridfleet/openssl), where the Makefile finds it.
# Why: AES-256-GCM is most of what TLS costs the bulk plane, and OpenSSL 3.0 (Debian 12's)
# has no VAES/AVX-512 code for it; 3.5 seals and opens 16 KiB records about 2.3x faster on a
# CPU that has VAES (docs/SCALE.md, "TLS at the cipher's cost"). Linked statically with its
# symbols hidden, it cannot clash with the libssl.so.3 Python's own ssl module loads.
# Optional: if the source cannot be fetched or built, the extension links the system's
# libssl-dev (.ci/install-build-deps.sh) and everything works, only slower. Idempotent.
set -euo pipefail
PREFIX=${HFLEET_OPENSSL_PREFIX:-/opt/hybridfleet/openssl}
if [ -f "$PREFIX/.built" ]; then
  exit 0
fi
command -v gcc >/dev/null && command -v make >/dev/null && command -v perl >/dev/null || {
  echo "install-openssl: gcc, make and perl are needed; the native TLS links the system OpenSSL" >&2; exit 0; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/src"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
echo "deb-src [signed-by=$keyring] http://deb.debian.org/debian trixie main" > "$work/sources.list"
# apt on this one source list, its own index and cache: the system's apt state is left alone
apt_opts=(-o Dir::Etc::SourceList="$work/sources.list" -o Dir::Etc::SourceParts=/nonexistent
          -o Dir::State::Lists="$work/lists" -o Dir::Cache="$work/cache")
apt_src() { apt-get -q "${apt_opts[@]}" -o APT::Sandbox::User=root "$@"; }
fetched=""
if apt_src update >/dev/null; then
  # newest first; the index can name a version whose files the mirror does not hold yet
  for version in $(apt-cache "${apt_opts[@]}" showsrc openssl | sed -n 's/^Version: //p' | sort -rV); do
    if (cd "$work/src" && apt_src source --download-only "openssl=$version" >/dev/null 2>&1); then
      fetched=$version; break
    fi
    rm -f "$work"/src/*
  done
fi
if [ -z "$fetched" ]; then
  echo "install-openssl: could not fetch Debian trixie's openssl source; the native TLS links the system OpenSSL" >&2
  exit 0
fi
tarball=$(ls "$work"/src/openssl_3.*.orig.tar.gz | head -n1)
tar -xzf "$tarball" -C "$work/src"
cd "$work"/src/openssl-3.*/
# static, position-independent (it goes into a shared extension), no shared libraries,
# apps, tests or docs; its own OPENSSLDIR so no other OpenSSL's openssl.cnf is read
if ! { ./Configure --prefix="$PREFIX" --libdir=lib --openssldir="$PREFIX/ssl" \
           no-shared no-module no-legacy no-tests no-docs no-apps -fPIC \
         && make -j"$(nproc)" build_libs && rm -rf "$PREFIX" && make install_dev; } > "$work/build.log" 2>&1; then
  tail -n 30 "$work/build.log" >&2
  echo "install-openssl: building OpenSSL $fetched failed; the native TLS links the system OpenSSL" >&2
  rm -rf "$PREFIX"
  exit 0
fi
echo "install-openssl: OpenSSL $fetched (static) in $PREFIX"
touch "$PREFIX/.built"
