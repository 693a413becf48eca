/* A TLS connection whose record loop runs in C: the bulk data plane's transport.
 *
 * Python's ssl module returns at most one TLS record (16 KiB) per recv call, so a
 * 64 MB pull costs about 4,000 trips through the interpreter and the GIL, plus two
 * read syscalls per record. Here a whole frame is read (or written) by one call
 * with the GIL released: SSL_read_ex in a loop straight into the caller's buffer,
 * records read through a reader BIO whose one recv syscall fetches many of them, and
 * records to send collected in a BIO pair so that one send syscall carries many. The cipher, the
 * handshake and the certificate checks are OpenSSL's, configured from the same
 * files and settings as the Python ssl.SSLContext (see `hybridfleet.ps.wire.tls`).
 * Between two of these connections the bytes after the handshake travel in sealed
 * records (AES-256-GCM under keys from TLS 1.3's exporter, opened in the caller's
 * buffer; see "Sealed records" below), chosen by ALPN; with any other peer, TLS records.
 *
 * Timeouts: ``settimeout(t)`` bounds each wait for progress (as a socket's timeout
 * bounds each recv); ``deadline`` (time.monotonic() seconds) bounds a whole call.
 * The socket is non-blocking underneath and waits happen in poll().
 *
 * Built optionally (see pyproject.toml); without it the Python ssl path is used.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#if OPENSSL_VERSION_NUMBER < 0x30000000L /* OpenSSL 1.1.1 */
#define SSL_get1_peer_certificate SSL_get_peer_certificate
#endif
#ifndef SSL_R_UNEXPECTED_EOF_WHILE_READING
#define SSL_R_UNEXPECTED_EOF_WHILE_READING 294
#endif

#ifndef WRITE_BUFFER_BYTES
#define WRITE_BUFFER_BYTES (256 * 1024) /* records sent per send syscall: ~16 instead of one */
#endif
/* The pair's size between large writes: one record's worth. A connection keeps only this
 * while idle, and takes the large pair for a write of more than this (see `pair_for`), so
 * that a shard with thousands of idle connections does not hold 256 KiB for each. */
#define IDLE_WRITE_BUFFER_BYTES (17 * 1024)
#ifndef READ_BUFFER_BYTES
#define READ_BUFFER_BYTES (256 * 1024) /* received per recv syscall during a large read: ~16 records */
#endif
/* The receive buffer for small reads (a frame's first bytes, a handshake): one record's worth. */
#define IDLE_READ_BUFFER_BYTES (17 * 1024)

static PyObject *SSLError, *SSLCertVerificationError, *SSLEOFError;

/* ------------------------------------------------------------------ Context */
typedef struct {
    PyObject_HEAD
    SSL_CTX *ctx;
    int server_side, check_hostname, hostname_checks_common_name;
    int sealed; /* offer (client) or accept (server) sealed records, see "Sealed records" below */
    char *keylog; /* NSS key log file (SSLKEYLOGFILE's format), or NULL */
} ContextObject;

/* ALPN's name for sealed records: wire format, a length byte then the name */
static const unsigned char SEALED_ALPN[] = "\x0fhfleet-sealed/1";
#define SEALED_ALPN_LEN (sizeof SEALED_ALPN - 1)

static int raise_ssl_error(unsigned long err, SSL *ssl, const char *hostname);

static void Context_dealloc(ContextObject *self) {
    SSL_CTX_free(self->ctx);
    free(self->keylog);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int tls_version(long v) { return v < 0 ? 0 : (int)v; } /* MINIMUM/MAXIMUM_SUPPORTED: no bound */

/* The server picks sealed records when the client offers them; else no ALPN at all (plain TLS). */
static int select_sealed(SSL *ssl, const unsigned char **out, unsigned char *outlen, const unsigned char *in,
                         unsigned int inlen, void *arg) {
    (void)ssl, (void)arg;
    for (unsigned int i = 0; i < inlen; i += 1u + in[i]) {
        if (i + 1u + in[i] > inlen) break;
        if (in[i] == SEALED_ALPN_LEN - 1 && memcmp(in + i, SEALED_ALPN, SEALED_ALPN_LEN) == 0) {
            *out = in + i + 1;
            *outlen = in[i];
            return SSL_TLSEXT_ERR_OK;
        }
    }
    return SSL_TLSEXT_ERR_NOACK;
}

/* One line per secret, appended as the ssl module's keylog_filename does (for Wireshark and tests). */
static void write_keylog(const SSL *ssl, const char *line) {
    ContextObject *self = SSL_CTX_get_app_data(SSL_get_SSL_CTX(ssl));
    if (self == NULL || self->keylog == NULL) return;
    FILE *f = fopen(self->keylog, "a");
    if (f == NULL) return;
    fprintf(f, "%s\n", line);
    fclose(f);
}

static int Context_init(ContextObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"server_side", "cafile", "certfile", "keyfile", "verify_mode", "check_hostname",
                             "hostname_checks_common_name", "options", "min_version", "max_version",
                             "verify_flags", "ciphers", "sealed", "keylog_filename", NULL};
    int server_side, verify_mode, check_hostname, common_name, sealed = 1;
    const char *cafile, *certfile, *keyfile, *ciphers, *keylog = NULL;
    unsigned long long options;
    long min_version, max_version;
    unsigned long verify_flags;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "pzzzippKllkz|pz", kwlist, &server_side, &cafile, &certfile,
                                     &keyfile, &verify_mode, &check_hostname, &common_name, &options, &min_version,
                                     &max_version, &verify_flags, &ciphers, &sealed, &keylog))
        return -1;
    char *keylog_copy = NULL;
    if (keylog != NULL && *keylog && (keylog_copy = strdup(keylog)) == NULL) return PyErr_NoMemory(), -1;
    ERR_clear_error();
    SSL_CTX *ctx = SSL_CTX_new(server_side ? TLS_server_method() : TLS_client_method());
    if (ctx == NULL) return free(keylog_copy), raise_ssl_error(ERR_get_error(), NULL, NULL), -1;
    SSL_CTX_clear_options(ctx, SSL_CTX_get_options(ctx));
    SSL_CTX_set_options(ctx, (uint64_t)options);
    if (!SSL_CTX_set_min_proto_version(ctx, tls_version(min_version)) ||
        !SSL_CTX_set_max_proto_version(ctx, tls_version(max_version)) ||
        (ciphers != NULL && *ciphers && !SSL_CTX_set_cipher_list(ctx, ciphers)) ||
        (certfile != NULL && SSL_CTX_use_certificate_chain_file(ctx, certfile) != 1) ||
        (keyfile != NULL && SSL_CTX_use_PrivateKey_file(ctx, keyfile, SSL_FILETYPE_PEM) != 1) ||
        (certfile != NULL && keyfile != NULL && SSL_CTX_check_private_key(ctx) != 1) ||
        (cafile != NULL && SSL_CTX_load_verify_locations(ctx, cafile, NULL) != 1)) {
        raise_ssl_error(ERR_get_error(), NULL, NULL);
        SSL_CTX_free(ctx);
        free(keylog_copy);
        return -1;
    }
    X509_VERIFY_PARAM *param = SSL_CTX_get0_param(ctx);
    X509_VERIFY_PARAM_clear_flags(param, X509_VERIFY_PARAM_get_flags(param));
    X509_VERIFY_PARAM_set_flags(param, verify_flags);
    /* ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED, as the ssl module maps them */
    SSL_CTX_set_verify(ctx, verify_mode == 0 ? SSL_VERIFY_NONE
                            : SSL_VERIFY_PEER | (verify_mode == 2 ? SSL_VERIFY_FAIL_IF_NO_PEER_CERT : 0), NULL);
    /* RELEASE_BUFFERS: OpenSSL frees a connection's record buffers whenever they are empty, instead
     * of keeping them at their high-water mark for the connection's life. A large read or write
     * switches it off for its duration (see `perform`), so that the buffers are not freed and taken
     * again for every record. No read-ahead: OpenSSL 3.0 moves what is left of its read-ahead
     * buffer to the buffer's front before every record (a 256 KiB buffer meant ~8 copies of each
     * byte); the connection's reader (see `reader_read`) fetches many records per recv instead. */
    SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER | SSL_MODE_AUTO_RETRY |
                              SSL_MODE_RELEASE_BUFFERS);
    SSL_CTX_set_read_ahead(ctx, 0);
    /* Sealed records: the server selects them by ALPN and sends no session tickets (nothing follows
     * its handshake on the stream but sealed records; connections are never resumed). */
    if (sealed && server_side) {
        SSL_CTX_set_alpn_select_cb(ctx, select_sealed, NULL);
        SSL_CTX_set_num_tickets(ctx, 0);
    }
    SSL_CTX_set_app_data(ctx, self);
    if (keylog_copy != NULL) SSL_CTX_set_keylog_callback(ctx, write_keylog);
    if (self->ctx) SSL_CTX_free(self->ctx);
    free(self->keylog);
    self->keylog = keylog_copy;
    self->sealed = sealed;
    self->ctx = ctx;
    self->server_side = server_side;
    self->check_hostname = check_hostname;
    self->hostname_checks_common_name = common_name;
    return 0;
}

static PyTypeObject ContextType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hybridfleet.ps.wire._tls.Context",
    .tp_doc = "OpenSSL settings for TLS connections: one side (client or server), its files and checks.",
    .tp_basicsize = sizeof(ContextObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Context_init,
    .tp_dealloc = (destructor)Context_dealloc,
};

/* --------------------------------------------------------------- Connection */
typedef struct {
    PyObject_HEAD
    SSL *ssl;
    int fd;
    double timeout; /* < 0: wait forever for progress */
    int busy, closed;
    BIO *net; /* OpenSSL writes records into a BIO pair; this half sends them in large writes */
    int net_size; /* the pair's buffer: IDLE_WRITE_BUFFER_BYTES, or WRITE_BUFFER_BYTES during a large write */
    char *hostname; /* what the certificate is checked against, for error messages */
    /* Bytes received and not yet handed to OpenSSL: rbuf[rstart:rend] of rcap; rwant is the size a
     * new buffer gets (IDLE_READ_BUFFER_BYTES, or READ_BUFFER_BYTES during a large read). */
    char *rbuf;
    size_t rcap, rstart, rend, rwant;
    PyObject *context; /* the ContextObject (its SSL_CTX's app data is the context, for the key log) */
    /* Sealed records (see below): on once both ends agreed after the handshake. */
    int sealed, broken;
    EVP_CIPHER_CTX *seal, *open;
    unsigned char seal_iv[12], open_iv[12];
    uint64_t seal_seq, open_seq, seal_bytes, open_bytes; /* records and bytes under the current keys */
    uint64_t seal_epoch, open_epoch;                     /* keys used so far, each way: epoch + 1 */
    /* the record being received: its header, how much of its body and tag have arrived */
    unsigned char in_hdr[8], in_tag[16];
    size_t in_len, in_body, in_hdrn, in_tagn; /* bytes: its length, of its body, header and tag so far */
    int in_state, in_direct;
    /* plaintext of a record larger than the read that opened it, waiting for the next reads */
    char *pbuf;
    size_t pstart, pend;
    /* a sealed record still to send: sbuf[soff:slen] of scap */
    char *sbuf;
    size_t scap, soff, slen;
    const char *seal_error; /* why a sealed read or write failed (ST_SEALED) */
} ConnObject;

enum { ST_OK, ST_EOF, ST_TIMEOUT, ST_ERRNO, ST_SSL, ST_EINTR, ST_SEALED };

typedef struct { /* one call's progress, kept across GIL round trips (EINTR) */
    int result, saved_errno;
    unsigned long ssl_err;
    size_t done;
    double last_progress;
} Progress;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* the clock of Python's time.monotonic() */
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Wait until fd is readable/writable; ST_OK, ST_TIMEOUT, ST_ERRNO or ST_EINTR. */
static int wait_fd(int fd, int for_write, double timeout, double deadline, Progress *p) {
    double limit = -1;
    if (timeout >= 0) limit = p->last_progress + timeout;
    if (deadline > 0 && (limit < 0 || deadline < limit)) limit = deadline;
    int ms = -1;
    if (limit >= 0) {
        double left = limit - now_s();
        if (left <= 0) return ST_TIMEOUT;
        ms = left * 1000 >= INT_MAX ? INT_MAX : (int)ceil(left * 1000);
    }
    struct pollfd pfd = {.fd = fd, .events = for_write ? POLLOUT : POLLIN};
    int rc = poll(&pfd, 1, ms);
    if (rc == 0) return ST_TIMEOUT;
    if (rc < 0) {
        p->saved_errno = errno;
        return errno == EINTR ? ST_EINTR : ST_ERRNO;
    }
    return ST_OK;
}

/* After an SSL call returned <= 0: ST_OK to retry once the fd is ready (want_write set), or a final result. */
static int classify(ConnObject *self, int ret, int *want_write, Progress *p) {
    int e = SSL_get_error(self->ssl, ret);
    switch (e) {
    case SSL_ERROR_WANT_READ: *want_write = 0; return ST_OK;
    case SSL_ERROR_WANT_WRITE: *want_write = 1; return ST_OK;
    case SSL_ERROR_ZERO_RETURN: return ST_EOF;
    case SSL_ERROR_SYSCALL:
        if (errno == 0 || ERR_peek_error() != 0) {
            p->ssl_err = ERR_peek_error();
            return p->ssl_err ? ST_SSL : ST_EOF;
        }
        p->saved_errno = errno;
        return errno == EINTR ? ST_EINTR : ST_ERRNO;
    default: {
        unsigned long err = ERR_peek_error();
        if (ERR_GET_LIB(err) == ERR_LIB_SSL && ERR_GET_REASON(err) == SSL_R_UNEXPECTED_EOF_WHILE_READING) {
            p->ssl_err = err;
            return ST_EOF; /* a peer that closes without close_notify: end of stream, as ssl's recv says */
        }
        p->ssl_err = err;
        return ST_SSL;
    }
    }
}

typedef enum { OP_HANDSHAKE, OP_READ_SOME, OP_READ_ALL, OP_WRITE_ALL } Op;

/* ------------------------------------------------------------ the reader BIO
 * OpenSSL reads its records through this BIO: each recv syscall fetches up to rcap bytes (many
 * records during a large read) into the connection's buffer, which serves OpenSSL's small reads
 * (a record's 5-byte header, then its body) with one copy each. Retry semantics are a socket
 * BIO's: no data now -> retry-read (SSL_ERROR_WANT_READ), end of stream -> 0, else -1 with errno. */
static BIO_METHOD *reader_method;

static int reader_read(BIO *b, char *out, int len) {
    ConnObject *self = BIO_get_data(b);
    BIO_clear_retry_flags(b);
    if (len <= 0) return 0;
    if (self->rstart == self->rend) {
        self->rstart = self->rend = 0;
        if (self->rbuf == NULL || self->rcap != self->rwant) {
            free(self->rbuf);
            self->rcap = 0;
            if ((self->rbuf = malloc(self->rwant)) == NULL) {
                errno = ENOMEM;
                return -1;
            }
            self->rcap = self->rwant;
        }
        errno = 0;
        ssize_t got = recv(self->fd, self->rbuf, self->rcap, 0);
        if (got == 0) return 0;
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) BIO_set_retry_read(b);
            return -1;
        }
        self->rend = (size_t)got;
    }
    size_t k = self->rend - self->rstart;
    if (k > (size_t)len) k = (size_t)len;
    memcpy(out, self->rbuf + self->rstart, k);
    self->rstart += k;
    return (int)k;
}

static long reader_ctrl(BIO *b, int cmd, long num, void *ptr) {
    (void)num, (void)ptr;
    ConnObject *self = BIO_get_data(b);
    switch (cmd) {
    case BIO_CTRL_FLUSH: return 1;
    case BIO_CTRL_PENDING: return self ? (long)(self->rend - self->rstart) : 0;
    default: return 0;
    }
}

static int reader_create(BIO *b) {
    BIO_set_init(b, 1);
    return 1;
}

/* After a call: an empty buffer is freed, a large one holding little is traded for a small one, so
 * that an idle connection keeps at most IDLE_READ_BUFFER_BYTES of received bytes. */
static void trim_reader(ConnObject *self) {
    size_t left = self->rend - self->rstart;
    if (self->rbuf == NULL) return;
    if (left == 0) {
        free(self->rbuf);
        self->rbuf = NULL;
        self->rcap = self->rstart = self->rend = 0;
    } else if (self->rcap > IDLE_READ_BUFFER_BYTES && left <= IDLE_READ_BUFFER_BYTES) {
        char *small = malloc(IDLE_READ_BUFFER_BYTES);
        if (small == NULL) return; /* keep the large one */
        memcpy(small, self->rbuf + self->rstart, left);
        free(self->rbuf);
        self->rbuf = small;
        self->rcap = IDLE_READ_BUFFER_BYTES;
        self->rstart = 0;
        self->rend = left;
    }
}

/* Send what OpenSSL wrote into the BIO pair; ST_OK once all of it is on the socket. */
static int flush(ConnObject *self, double deadline, Progress *p) {
    for (;;) {
        char *ptr;
        int avail = BIO_nread0(self->net, &ptr);
        if (avail <= 0) return ST_OK;
        ssize_t sent = send(self->fd, ptr, (size_t)avail, MSG_NOSIGNAL);
        if (sent > 0) {
            BIO_nread(self->net, &ptr, (int)sent);
            p->last_progress = now_s();
            continue;
        }
        if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int r = wait_fd(self->fd, 1, self->timeout, deadline, p);
            if (r != ST_OK) return r;
            continue;
        }
        p->saved_errno = errno;
        return errno == EINTR ? ST_EINTR : ST_ERRNO;
    }
}

/* ----------------------------------------------------------- sealed records
 * After a TLS 1.3 handshake in which both ends agreed on it (ALPN "hfleet-sealed/1"), the
 * connection's bytes travel in sealed records instead of TLS records: the same AEAD (AES-256-GCM),
 * keyed from the handshake by TLS 1.3's exporter (RFC 8446 7.5, as DTLS-SRTP keys media from DTLS),
 * laid out so that a record is opened in the caller's buffer and sealed from it. OpenSSL's record
 * layer copies every byte into its record buffer and out again (no call seals from or opens into the
 * caller's buffer); here the receiver reads a record's body straight into the frame it belongs to
 * and decrypts it there, and the sender seals the caller's bytes into the buffer it sends from, so
 * what TLS adds to a transfer is the cipher itself.
 *
 *   record  = header(8) | ciphertext(length) | tag(16)
 *   header  = 0xB7 | 0x01 | 0x00 0x00 | length (u32, big-endian, 1 .. SEALED_MAX_RECORD)
 *   keys    = TLS-Exporter("EXPORTER-hybridfleet-sealed-records", epoch as u64 big-endian, 88):
 *             client-to-server key(32) | server-to-client key(32) | c2s iv(12) | s2c iv(12)
 *   nonce   = iv XOR the record's sequence number under that key (u64 big-endian in the last 8
 *             bytes), as TLS 1.3 forms its nonces; additional data = the header.
 *
 * Each direction moves to the next epoch's keys before a record once SEALED_REKEY_BYTES were sealed
 * under the current ones (TLS 1.3 bounds AES-GCM at ~2^24.5 full records, ~2^38.5 bytes, per key).
 * A record that fails its tag, a header that is not one, or one longer than SEALED_MAX_RECORD ends
 * the connection with ssl.SSLError; the bytes of the failed record in the caller's buffer are zeroed
 * first (as are those of a record the stream ends or fails inside), and every later call fails too. Implicit sequence numbers make a replayed, dropped or
 * reordered record fail its tag. The peer's certificate, the host-name checks and the bearer tokens
 * are the handshake's and the bulk protocol's, unchanged. A TLS alert in place of the first record (a
 * server that refused the client's certificate after the client's handshake completed) is read by
 * OpenSSL, so it raises what it raises on TLS records. */
#define SEALED_TYPE 0xB7
#define SEALED_FORMAT 1
#define SEALED_HEADER 8
#define SEALED_TAG 16
#ifndef SEALED_MAX_RECORD
#define SEALED_MAX_RECORD (1024 * 1024) /* 1 MiB: a record fills one send syscall (64-256 KiB cost 1.4-2.5x the cipher) */
#endif
#define SEALED_LABEL "EXPORTER-hybridfleet-sealed-records"
/* A transfer whose remaining request is below this reads small records through the reader's buffer
 * (a small record, its tag and the next header in one recv); above it, exactly what a record needs. */
#define SEALED_SMALL_READ (64 * 1024)
static uint64_t sealed_rekey_bytes = (uint64_t)1 << 34; /* 16 GiB per key and direction; tests lower it */

enum { IN_HEADER, IN_BODY, IN_TAG };

static int sealed_fail(ConnObject *self, const char *why) {
    self->seal_error = why;
    self->broken = 1;
    return ST_SEALED;
}

/* Keys for one direction at ``epoch`` (``sending``: the ones this end seals with). 0, or -1. */
static int sealed_keys(ConnObject *self, int sending, uint64_t epoch) {
    unsigned char km[88], context[8];
    for (int i = 0; i < 8; i++) context[i] = (unsigned char)(epoch >> (56 - 8 * i));
    if (SSL_export_keying_material(self->ssl, km, sizeof km, SEALED_LABEL, strlen(SEALED_LABEL), context,
                                   sizeof context, 1) != 1)
        return -1;
    int client_to_server = SSL_is_server(self->ssl) ? !sending : sending;
    const unsigned char *key = km + (client_to_server ? 0 : 32), *iv = km + 64 + (client_to_server ? 0 : 12);
    int ok = sending ? EVP_EncryptInit_ex(self->seal, EVP_aes_256_gcm(), NULL, key, NULL)
                     : EVP_DecryptInit_ex(self->open, EVP_aes_256_gcm(), NULL, key, NULL);
    memcpy(sending ? self->seal_iv : self->open_iv, iv, 12);
    OPENSSL_cleanse(km, sizeof km);
    if (ok != 1) return -1;
    if (sending) self->seal_seq = self->seal_bytes = 0, self->seal_epoch = epoch + 1;
    else self->open_seq = self->open_bytes = 0, self->open_epoch = epoch + 1;
    return 0;
}

static void sealed_nonce(const unsigned char iv[12], uint64_t seq, unsigned char out[12]) {
    memcpy(out, iv, 12);
    for (int i = 0; i < 8; i++) out[4 + i] ^= (unsigned char)(seq >> (56 - 8 * i));
}

/* After the handshake: sealed records when both ends chose them (ALPN) over TLS 1.3. 0, or -1. */
static int enter_sealed(ConnObject *self) {
    const unsigned char *alpn = NULL;
    unsigned int alpn_len = 0;
    if (self->sealed || self->seal != NULL) return 0; /* decided at the first completed handshake */
    SSL_get0_alpn_selected(self->ssl, &alpn, &alpn_len);
    self->seal = EVP_CIPHER_CTX_new();
    self->open = EVP_CIPHER_CTX_new();
    if (self->seal == NULL || self->open == NULL) return -1;
    if (alpn_len != SEALED_ALPN_LEN - 1 || memcmp(alpn, SEALED_ALPN + 1, alpn_len) != 0 ||
        SSL_version(self->ssl) != TLS1_3_VERSION)
        return 0; /* plain TLS records */
    if (sealed_keys(self, 1, 0) < 0 || sealed_keys(self, 0, 0) < 0) return -1;
    self->in_state = IN_HEADER;
    self->sealed = 1;
    return 0;
}

/* Up to ``want`` received bytes into ``dst`` (*got > 0), from what the reader's buffer holds first.
 * With ``refill`` an empty reader's buffer is filled by one recv first; else the socket is read
 * into ``dst`` directly. ST_OK, ST_EOF or a failure. */
static int pull(ConnObject *self, char *dst, size_t want, int refill, size_t *got, double deadline, Progress *p) {
    for (;;) {
        size_t have = self->rend - self->rstart;
        ssize_t r;
        if (have == 0 && refill) {
            self->rstart = self->rend = 0;
            if (self->rbuf == NULL || self->rcap != self->rwant) {
                free(self->rbuf);
                self->rcap = 0;
                if ((self->rbuf = malloc(self->rwant)) == NULL) {
                    p->saved_errno = ENOMEM;
                    return ST_ERRNO;
                }
                self->rcap = self->rwant;
            }
            r = recv(self->fd, self->rbuf, self->rcap, 0);
            if (r > 0) {
                self->rend = (size_t)r;
                have = (size_t)r;
                p->last_progress = now_s();
            }
        } else if (have == 0) {
            r = recv(self->fd, dst, want, 0);
            if (r > 0) {
                *got = (size_t)r;
                p->last_progress = now_s();
                return ST_OK;
            }
        } else {
            r = 1;
        }
        if (have > 0) {
            size_t k = have < want ? have : want;
            memcpy(dst, self->rbuf + self->rstart, k);
            self->rstart += k;
            *got = k;
            return ST_OK;
        }
        if (r == 0) return ST_EOF;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int w = wait_fd(self->fd, 0, self->timeout, deadline, p);
            if (w != ST_OK) return w;
            continue;
        }
        p->saved_errno = errno;
        return errno == EINTR ? ST_EINTR : ST_ERRNO;
    }
}

/* A TLS record where the first sealed one was due: give its bytes back to OpenSSL, which reads the
 * alert (or whatever it is) through the reader and fails as it fails on TLS records. */
static int hand_to_openssl(ConnObject *self, double deadline, Progress *p) {
    size_t left = self->rend - self->rstart, n = self->in_hdrn + left;
    char *back = malloc(n > self->rwant ? n : self->rwant);
    if (back == NULL) {
        p->saved_errno = ENOMEM;
        return ST_ERRNO;
    }
    memcpy(back, self->in_hdr, self->in_hdrn);
    if (left) memcpy(back + self->in_hdrn, self->rbuf + self->rstart, left);
    free(self->rbuf);
    self->rbuf = back;
    self->rcap = n > self->rwant ? n : self->rwant;
    self->rstart = 0;
    self->rend = n;
    self->in_hdrn = 0;
    for (;;) {
        char scratch[256];
        size_t k = 0;
        int want_write = 0;
        errno = 0;
        if (SSL_read_ex(self->ssl, scratch, sizeof scratch, &k) == 1)
            return sealed_fail(self, "the peer sent a TLS record where sealed records were agreed");
        int r = classify(self, 0, &want_write, p);
        if (r != ST_OK) {
            self->broken = 1;
            return r;
        }
        r = flush(self, deadline, p);
        if (r == ST_OK) r = wait_fd(self->fd, want_write, self->timeout, deadline, p);
        if (r != ST_OK) return r;
    }
}

/* A read that failed inside a record: what of the record was opened (not yet authenticated) is
 * zeroed, and the stream is out of step for good. A read that only has to wait keeps a record
 * that goes to the plaintext buffer (the next read goes on with it). */
static int abandon_record(ConnObject *self, char *dst, int r) {
    if (r == ST_EINTR || (!self->in_direct && r == ST_TIMEOUT)) return r;
    OPENSSL_cleanse(dst, self->in_body);
    if (!self->in_direct) free(self->pbuf), self->pbuf = NULL;
    self->broken = 1;
    return r;
}

/* Read sealed records into buf[p->done:n] (OP_READ_ALL: all of it; OP_READ_SOME: at least a byte). */
static int sealed_read(ConnObject *self, Op op, char *buf, size_t n, double deadline, Progress *p) {
    if (self->broken) return sealed_fail(self, "the sealed record stream broke off earlier; the connection is unusable");
    for (;;) {
        if (self->pstart < self->pend) { /* what an earlier record left for the next reads */
            size_t k = self->pend - self->pstart;
            if (k > n - p->done) k = n - p->done;
            memcpy(buf + p->done, self->pbuf + self->pstart, k);
            self->pstart += k;
            p->done += k;
        }
        if (p->done >= n || (op == OP_READ_SOME && p->done > 0)) return ST_OK;
        size_t remaining = n - p->done, got = 0;
        int small = op == OP_READ_SOME || remaining < SEALED_SMALL_READ, r;
        if (self->in_state == IN_HEADER) {
            r = pull(self, (char *)self->in_hdr + self->in_hdrn, SEALED_HEADER - self->in_hdrn, small, &got, deadline,
                     p);
            if (r != ST_OK) return r; /* EOF here, between records, is the stream's end */
            self->in_hdrn += got;
            if (self->in_hdr[0] != SEALED_TYPE && self->open_epoch == 1 && self->open_seq == 0 &&
                self->in_hdr[0] >= 20 && self->in_hdr[0] <= 24)
                return hand_to_openssl(self, deadline, p);
            if (self->in_hdrn < SEALED_HEADER) continue;
            self->in_hdrn = 0;
            const unsigned char *h = self->in_hdr;
            size_t len = (size_t)h[4] << 24 | (size_t)h[5] << 16 | (size_t)h[6] << 8 | h[7];
            if (h[0] != SEALED_TYPE || h[1] != SEALED_FORMAT || h[2] || h[3])
                return sealed_fail(self, "a sealed record's header is not one (wrong type or format)");
            if (len == 0 || len > SEALED_MAX_RECORD)
                return sealed_fail(self, "a sealed record's length is 0 or over its limit (1 MiB)");
            if (self->open_bytes >= sealed_rekey_bytes && sealed_keys(self, 0, self->open_epoch) < 0)
                return sealed_fail(self, "the next sealed record keys could not be derived");
            unsigned char nonce[12];
            int outl = 0;
            sealed_nonce(self->open_iv, self->open_seq, nonce);
            if (EVP_DecryptInit_ex(self->open, NULL, NULL, NULL, nonce) != 1 ||
                EVP_DecryptUpdate(self->open, NULL, &outl, h, SEALED_HEADER) != 1)
                return sealed_fail(self, "AES-256-GCM could not start opening a sealed record");
            self->in_len = len;
            self->in_body = 0;
            self->in_direct = op == OP_READ_ALL && len <= remaining;
            if (!self->in_direct) {
                free(self->pbuf);
                self->pstart = self->pend = 0;
                if ((self->pbuf = malloc(len)) == NULL) {
                    p->saved_errno = ENOMEM;
                    self->broken = 1;
                    return ST_ERRNO;
                }
            }
            self->in_state = IN_BODY;
        }
        char *dst = self->in_direct ? buf + p->done : self->pbuf;
        if (self->in_state == IN_BODY) {
            r = pull(self, dst + self->in_body, self->in_len - self->in_body, small && !self->in_direct, &got, deadline,
                     p);
            if (r != ST_OK) return abandon_record(self, dst, r);
            int outl = 0;
            if (EVP_DecryptUpdate(self->open, (unsigned char *)dst + self->in_body, &outl,
                                  (unsigned char *)dst + self->in_body, (int)got) != 1)
                return sealed_fail(self, "AES-256-GCM failed opening a sealed record");
            self->in_body += got;
            if (self->in_body == self->in_len) self->in_state = IN_TAG, self->in_tagn = 0;
            continue;
        }
        /* IN_TAG */
        r = pull(self, (char *)self->in_tag + self->in_tagn, SEALED_TAG - self->in_tagn, small, &got, deadline, p);
        if (r != ST_OK) return abandon_record(self, dst, r);
        self->in_tagn += got;
        if (self->in_tagn < SEALED_TAG) continue;
        self->in_tagn = 0;
        unsigned char last[16];
        int outl = 0;
        if (EVP_CIPHER_CTX_ctrl(self->open, EVP_CTRL_GCM_SET_TAG, SEALED_TAG, self->in_tag) != 1 ||
            EVP_DecryptFinal_ex(self->open, last, &outl) != 1) {
            OPENSSL_cleanse(dst, self->in_len); /* nothing of a record that failed its tag is left to read */
            if (!self->in_direct) free(self->pbuf), self->pbuf = NULL;
            return sealed_fail(self, "a sealed record failed authentication (decryption failed or bad record mac)");
        }
        self->open_seq++;
        self->open_bytes += self->in_len;
        self->in_state = IN_HEADER;
        if (self->in_direct) {
            p->done += self->in_len;
        } else {
            self->pstart = 0;
            self->pend = self->in_len;
        }
        p->last_progress = now_s();
    }
}

/* Seal buf[p->done:n] into records and send them. */
static int sealed_write(ConnObject *self, const char *buf, size_t n, double deadline, Progress *p) {
    if (self->broken) return sealed_fail(self, "the sealed record stream broke off earlier; the connection is unusable");
    for (;;) {
        while (self->soff < self->slen) {
            ssize_t sent = send(self->fd, self->sbuf + self->soff, self->slen - self->soff, MSG_NOSIGNAL);
            if (sent > 0) {
                self->soff += (size_t)sent;
                p->last_progress = now_s();
                continue;
            }
            int r;
            if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                r = wait_fd(self->fd, 1, self->timeout, deadline, p);
                if (r == ST_OK) continue;
            } else {
                p->saved_errno = errno;
                r = errno == EINTR ? ST_EINTR : ST_ERRNO;
            }
            if (r != ST_EINTR) self->broken = 1; /* a record went out in part, or not at all while counted */
            return r;
        }
        if (p->done >= n) return ST_OK;
        size_t len = n - p->done < SEALED_MAX_RECORD ? n - p->done : SEALED_MAX_RECORD;
        size_t need = SEALED_HEADER + len + SEALED_TAG;
        if (self->scap < need) {
            free(self->sbuf);
            self->scap = 0;
            if ((self->sbuf = malloc(need)) == NULL) {
                p->saved_errno = ENOMEM;
                return ST_ERRNO;
            }
            self->scap = need;
        }
        if (self->seal_bytes >= sealed_rekey_bytes && sealed_keys(self, 1, self->seal_epoch) < 0)
            return sealed_fail(self, "the next sealed record keys could not be derived");
        unsigned char *h = (unsigned char *)self->sbuf, nonce[12];
        h[0] = SEALED_TYPE, h[1] = SEALED_FORMAT, h[2] = h[3] = 0;
        h[4] = (unsigned char)(len >> 24), h[5] = (unsigned char)(len >> 16), h[6] = (unsigned char)(len >> 8);
        h[7] = (unsigned char)len;
        sealed_nonce(self->seal_iv, self->seal_seq, nonce);
        int outl = 0, last = 0;
        if (EVP_EncryptInit_ex(self->seal, NULL, NULL, NULL, nonce) != 1 ||
            EVP_EncryptUpdate(self->seal, NULL, &outl, h, SEALED_HEADER) != 1 ||
            EVP_EncryptUpdate(self->seal, h + SEALED_HEADER, &outl, (const unsigned char *)buf + p->done, (int)len) != 1 ||
            EVP_EncryptFinal_ex(self->seal, h + SEALED_HEADER + outl, &last) != 1 ||
            EVP_CIPHER_CTX_ctrl(self->seal, EVP_CTRL_GCM_GET_TAG, SEALED_TAG, h + SEALED_HEADER + len) != 1)
            return sealed_fail(self, "AES-256-GCM failed sealing a record");
        self->seal_seq++;
        self->seal_bytes += len;
        self->soff = 0;
        self->slen = need;
        p->done += len;
    }
}

/* After a call: what the sealed layer holds while idle goes (an empty plaintext or send buffer). */
static void trim_sealed(ConnObject *self) {
    if (self->pbuf != NULL && self->pstart == self->pend && self->in_state != IN_BODY && self->in_state != IN_TAG) {
        free(self->pbuf);
        self->pbuf = NULL;
        self->pstart = self->pend = 0;
    }
    if (self->sbuf != NULL && self->soff == self->slen) {
        free(self->sbuf);
        self->sbuf = NULL;
        self->scap = self->soff = self->slen = 0;
    }
}

/* Run one operation until it completes or fails; called without the GIL. */
static void run_op(ConnObject *self, Op op, char *buf, size_t n, double deadline, Progress *p) {
    if (self->sealed && op != OP_HANDSHAKE) {
        p->result = op == OP_WRITE_ALL ? sealed_write(self, buf, n, deadline, p) : sealed_read(self, op, buf, n, deadline, p);
        return;
    }
    for (;;) {
        int want_write = 0, ret, r;
        size_t k = 0;
        errno = 0;
        if (op == OP_HANDSHAKE) {
            ret = SSL_do_handshake(self->ssl);
            if (ret == 1) {
                p->result = flush(self, deadline, p);
                if (p->result == ST_OK && enter_sealed(self) < 0) p->result = sealed_fail(self, "sealed record keys could not be derived");
                return;
            }
        } else if (op == OP_WRITE_ALL) {
            if (p->done >= n) { p->result = flush(self, deadline, p); return; }
            ret = SSL_write_ex(self->ssl, buf + p->done, n - p->done, &k);
            if (ret == 1) { p->done += k; continue; } /* records pile up in the pair until it is full */
        } else {
            if (p->done >= n && n > 0) { p->result = ST_OK; return; }
            ret = SSL_read_ex(self->ssl, buf + p->done, n - p->done, &k);
            if (ret == 1) {
                p->done += k;
                p->last_progress = now_s();
                if (op == OP_READ_SOME || p->done >= n) {
                    p->result = BIO_ctrl_pending(self->net) ? flush(self, deadline, p) : ST_OK; /* e.g. a KeyUpdate reply */
                    return;
                }
                continue;
            }
        }
        r = classify(self, ret, &want_write, p);
        if (r != ST_OK) {
            if (r == ST_SSL) flush(self, deadline, p); /* the alert that tells the peer why, if it can go */
            p->result = r;
            return;
        }
        /* WANT_WRITE: the pair is full; WANT_READ: what was written must be sent before waiting for the answer */
        r = flush(self, deadline, p);
        if (r == ST_OK && !want_write) r = wait_fd(self->fd, 0, self->timeout, deadline, p);
        if (r != ST_OK) { p->result = r; return; }
    }
}

static void release(ConnObject *self) {
    if (self->ssl) SSL_free(self->ssl);
    if (self->net) BIO_free(self->net);
    self->net = NULL;
    if (self->fd >= 0) close(self->fd);
    free(self->rbuf);
    self->rbuf = NULL;
    self->rcap = self->rstart = self->rend = 0;
    EVP_CIPHER_CTX_free(self->seal); /* clears the keys */
    EVP_CIPHER_CTX_free(self->open);
    self->seal = self->open = NULL;
    if (self->pbuf != NULL) OPENSSL_cleanse(self->pbuf, self->pend);
    free(self->pbuf);
    free(self->sbuf);
    self->pbuf = self->sbuf = NULL;
    self->pstart = self->pend = self->scap = self->soff = self->slen = 0;
    self->ssl = NULL;
    self->fd = -1;
}

static int check_open(ConnObject *self) {
    if (self->closed || self->ssl == NULL) {
        errno = EBADF;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the TLS connection is in use by another thread");
        return -1;
    }
    return 0;
}

static const char *lib_name(int lib) {
    switch (lib) {
    case ERR_LIB_SSL: return "SSL";
    case ERR_LIB_X509: return "X509";
    case ERR_LIB_X509V3: return "X509V3";
    case ERR_LIB_PEM: return "PEM";
    case ERR_LIB_ASN1: return "ASN1";
    case ERR_LIB_EVP: return "EVP";
    case ERR_LIB_SYS: return "SYS";
    default: return "SSL";
    }
}

/* "certificate verify failed" -> "CERTIFICATE_VERIFY_FAILED": OpenSSL's reason mnemonics, as ssl prints them. */
static void mnemonic(const char *reason, char *out, size_t size) {
    size_t i = 0;
    for (; reason[i] && i + 1 < size; i++) out[i] = reason[i] == ' ' ? '_' : (char)toupper((unsigned char)reason[i]);
    out[i] = 0;
}

static void set_attr(PyObject *obj, const char *name, PyObject *value) {
    if (value != NULL) PyObject_SetAttrString(obj, name, value);
    Py_XDECREF(value);
    PyErr_Clear();
}

/* Raise the ssl module's exception for an OpenSSL error, with the text ssl would show. */
static int raise_ssl_error(unsigned long err, SSL *ssl, const char *hostname) {
    const char *reason = err ? ERR_reason_error_string(err) : NULL;
    char name[128], msg[512];
    PyObject *cls = SSLError;
    long verify_code = 0;
    const char *verify_message = NULL;
    char verify_text[256];
    if (reason == NULL) reason = "unknown error";
    mnemonic(reason, name, sizeof name);
    if (ERR_GET_LIB(err) == ERR_LIB_SSL && ERR_GET_REASON(err) == SSL_R_CERTIFICATE_VERIFY_FAILED && ssl != NULL) {
        cls = SSLCertVerificationError;
        verify_code = SSL_get_verify_result(ssl);
        if (verify_code == X509_V_ERR_HOSTNAME_MISMATCH || verify_code == X509_V_ERR_IP_ADDRESS_MISMATCH) {
            snprintf(verify_text, sizeof verify_text, "%s mismatch, certificate is not valid for '%s'.",
                     verify_code == X509_V_ERR_IP_ADDRESS_MISMATCH ? "IP address" : "Hostname",
                     hostname ? hostname : "");
            verify_message = verify_text;
        } else {
            verify_message = X509_verify_cert_error_string(verify_code);
        }
        snprintf(msg, sizeof msg, "[%s: %s] %s: %s", lib_name(ERR_GET_LIB(err)), name, reason, verify_message);
    } else {
        if (ERR_GET_LIB(err) == ERR_LIB_SSL && ERR_GET_REASON(err) == SSL_R_UNEXPECTED_EOF_WHILE_READING)
            cls = SSLEOFError;
        snprintf(msg, sizeof msg, "[%s: %s] %s", lib_name(ERR_GET_LIB(err)), name, reason);
    }
    ERR_clear_error();
    PyObject *exc = PyObject_CallFunction(cls, "is", cls == SSLEOFError ? 8 : 1, msg);
    if (exc == NULL) return -1;
    set_attr(exc, "library", PyUnicode_FromString(lib_name(ERR_GET_LIB(err))));
    set_attr(exc, "reason", PyUnicode_FromString(name));
    if (cls == SSLCertVerificationError) {
        set_attr(exc, "verify_code", PyLong_FromLong(verify_code));
        set_attr(exc, "verify_message", PyUnicode_FromString(verify_message));
    }
    PyErr_SetObject(cls, exc);
    Py_DECREF(exc);
    return -1;
}

/* ssl.SSLError for a sealed record that failed (reason SEALED_RECORD_FAILED, library SSL). */
static void raise_sealed_error(const char *why) {
    char msg[256];
    snprintf(msg, sizeof msg, "[SSL: SEALED_RECORD_FAILED] %s", why ? why : "sealed record failed");
    PyObject *exc = PyObject_CallFunction(SSLError, "is", 1, msg);
    if (exc == NULL) return;
    set_attr(exc, "library", PyUnicode_FromString("SSL"));
    set_attr(exc, "reason", PyUnicode_FromString("SEALED_RECORD_FAILED"));
    PyErr_SetObject(SSLError, exc);
    Py_DECREF(exc);
}

/* Give the connection a write pair of ``size`` bytes, once the current one is drained (what is
 * still in it stays where it is: the swap waits for the next call). 0 on success, -1 when no
 * memory was left (the old pair is kept). */
static int pair_for(ConnObject *self, int size) {
    if (self->net_size == size || self->ssl == NULL || BIO_ctrl_pending(self->net) != 0) return 0;
    BIO *inner = NULL, *outer = NULL;
    if (!BIO_new_bio_pair(&inner, size, &outer, 1)) {
        ERR_clear_error();
        return -1;
    }
    SSL_set0_wbio(self->ssl, inner); /* frees the old inner half, which unpairs the old outer one */
    BIO_free(self->net);
    self->net = outer;
    self->net_size = size;
    return 0;
}

/* After a large call: OpenSSL's record buffers are freed again when empty (as between small calls). */
static void keep_buffers_while_idle(ConnObject *self) {
    if (self->ssl == NULL) return;
    SSL_set_mode(self->ssl, SSL_MODE_RELEASE_BUFFERS);
    if (!SSL_has_pending(self->ssl)) SSL_free_buffers(self->ssl);
}

/* Run ``op`` with the GIL released; returns the Progress (result ST_OK/ST_EOF) or NULL-equivalent -1 with an exception. */
static int perform(ConnObject *self, Op op, char *buf, size_t n, double deadline, Progress *p, const char *what) {
    memset(p, 0, sizeof *p);
    p->last_progress = now_s();
    int large = op != OP_HANDSHAKE && n > IDLE_WRITE_BUFFER_BYTES && !self->sealed; /* sealed: OpenSSL's buffers idle */
    if (op == OP_WRITE_ALL && large) pair_for(self, WRITE_BUFFER_BYTES); /* else the small one */
    if (large) SSL_clear_mode(self->ssl, SSL_MODE_RELEASE_BUFFERS);
    self->rwant = large && op != OP_WRITE_ALL ? READ_BUFFER_BYTES : IDLE_READ_BUFFER_BYTES;
    self->busy = 1;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        run_op(self, op, buf, n, deadline, p);
        Py_END_ALLOW_THREADS
        if (p->result != ST_EINTR) break;
        if (PyErr_CheckSignals() < 0) { self->busy = 0; ERR_clear_error(); goto done_error; }
    }
    self->busy = 0;
    if (large) keep_buffers_while_idle(self);
    if (!self->closed) trim_reader(self), trim_sealed(self);
    if (self->net_size != IDLE_WRITE_BUFFER_BYTES && !self->closed) pair_for(self, IDLE_WRITE_BUFFER_BYTES);
    switch (p->result) {
    case ST_OK:
    case ST_EOF:
        ERR_clear_error();
        if (self->closed) release(self); /* close() came from another thread meanwhile */
        return 0;
    case ST_TIMEOUT:
        ERR_clear_error();
        PyErr_Format(PyExc_TimeoutError, "The %s operation timed out", what);
        break;
    case ST_ERRNO:
        ERR_clear_error();
        errno = p->saved_errno;
        PyErr_SetFromErrno(PyExc_OSError);
        break;
    case ST_SEALED:
        ERR_clear_error();
        raise_sealed_error(self->seal_error);
        break;
    default:
        raise_ssl_error(p->ssl_err, self->ssl, self->hostname);
    }
done_error:
    if (self->closed) release(self);
    return -1;
}

static int Conn_init(ConnObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"context", "fd", "server_hostname", NULL};
    ContextObject *ctx;
    int fd;
    const char *host = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!i|z", kwlist, &ContextType, &ctx, &fd, &host)) return -1;
    if (self->ssl != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "connection already initialised");
        return -1;
    }
    ERR_clear_error();
    SSL *ssl = SSL_new(ctx->ctx);
    if (ssl == NULL) return raise_ssl_error(ERR_get_error(), NULL, NULL);
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
        SSL_free(ssl);
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    BIO *sock_bio = BIO_new(reader_method), *inner = NULL, *outer = NULL;
    if (sock_bio != NULL) BIO_set_data(sock_bio, self);
    /* the outer half is only read from (what OpenSSL wrote into the inner one): its own buffer, for
     * writes into it that never come, is one byte */
    if (sock_bio == NULL || !BIO_new_bio_pair(&inner, IDLE_WRITE_BUFFER_BYTES, &outer, 1)) {
        BIO_free(sock_bio);
        SSL_free(ssl);
        return raise_ssl_error(ERR_get_error(), NULL, NULL);
    }
    SSL_set_bio(ssl, sock_bio, inner); /* reads through the connection's reader, writes into the pair */
    if (ctx->sealed && !ctx->server_side && SSL_set_alpn_protos(ssl, SEALED_ALPN, SEALED_ALPN_LEN) != 0) {
        SSL_free(ssl);
        BIO_free(outer);
        return raise_ssl_error(ERR_get_error(), NULL, NULL);
    }
    if (ctx->server_side) {
        SSL_set_accept_state(ssl);
    } else {
        SSL_set_connect_state(ssl);
        if (host != NULL && *host) {
            X509_VERIFY_PARAM *param = SSL_get0_param(ssl);
            int is_ip = X509_VERIFY_PARAM_set1_ip_asc(param, host) == 1;
            ERR_clear_error();
            if (!is_ip) SSL_set_tlsext_host_name(ssl, host); /* SNI carries names, never addresses */
            if (ctx->check_hostname && !is_ip) {
                X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS |
                    (ctx->hostname_checks_common_name ? 0 : X509_CHECK_FLAG_NEVER_CHECK_SUBJECT));
                if (X509_VERIFY_PARAM_set1_host(param, host, 0) != 1) {
                    SSL_free(ssl);
                    BIO_free(outer);
                    return raise_ssl_error(ERR_get_error(), NULL, NULL);
                }
            } else if (!ctx->check_hostname && is_ip) {
                X509_VERIFY_PARAM_set1_ip(param, NULL, 0);
            }
        } else if (ctx->check_hostname) {
            SSL_free(ssl);
            BIO_free(outer);
            PyErr_SetString(PyExc_ValueError, "check_hostname requires server_hostname");
            return -1;
        }
    }
    if (host != NULL && (self->hostname = strdup(host)) == NULL) {
        SSL_free(ssl);
        BIO_free(outer);
        PyErr_NoMemory();
        return -1;
    }
    self->ssl = ssl;
    Py_INCREF(ctx);
    self->context = (PyObject *)ctx; /* the key log callback finds its file through the SSL_CTX's app data */
    self->net = outer;
    self->net_size = IDLE_WRITE_BUFFER_BYTES;
    self->fd = fd; /* owned from here on */
    self->timeout = -1;
    self->rwant = IDLE_READ_BUFFER_BYTES;
    return 0;
}

static void Conn_dealloc(ConnObject *self) {
    release(self);
    Py_CLEAR(self->context);
    free(self->hostname);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Conn_do_handshake(ConnObject *self, PyObject *Py_UNUSED(ignored)) {
    Progress p;
    if (check_open(self) < 0 || perform(self, OP_HANDSHAKE, NULL, 0, 0, &p, "handshake") < 0) return NULL;
    if (p.result == ST_EOF) {
        PyObject *exc = PyObject_CallFunction(SSLEOFError, "is", 8, "EOF occurred in violation of protocol");
        if (exc != NULL) PyErr_SetObject(SSLEOFError, exc);
        Py_XDECREF(exc);
        return NULL;
    }
    Py_RETURN_NONE;
}

static double parse_deadline(PyObject *obj) {
    return obj == NULL || obj == Py_None ? 0 : PyFloat_AsDouble(obj);
}

static PyObject *Conn_recv_into(ConnObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"buffer", "nbytes", NULL};
    Py_buffer view;
    Py_ssize_t nbytes = 0;
    Progress p;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "w*|n", kwlist, &view, &nbytes)) return NULL;
    if (nbytes <= 0 || nbytes > view.len) nbytes = view.len;
    if (nbytes == 0 || check_open(self) < 0 || perform(self, OP_READ_SOME, view.buf, nbytes, 0, &p, "read") < 0) {
        PyBuffer_Release(&view);
        return PyErr_Occurred() ? NULL : PyLong_FromLong(0);
    }
    PyBuffer_Release(&view);
    return PyLong_FromSize_t(p.done);
}

static PyObject *Conn_recv(ConnObject *self, PyObject *args) {
    Py_ssize_t n;
    Progress p;
    if (!PyArg_ParseTuple(args, "n", &n)) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL) return NULL;
    if (n == 0) return out;
    if (check_open(self) < 0 || perform(self, OP_READ_SOME, PyBytes_AS_STRING(out), n, 0, &p, "read") < 0) {
        Py_DECREF(out);
        return NULL;
    }
    if (_PyBytes_Resize(&out, p.done) < 0) return NULL;
    return out;
}

/* recv_exact_into / sendall: move all of ``view`` (released here) or raise; an early end of stream is
 * EOFError when reading and EPIPE when writing. */
static PyObject *transfer_all(ConnObject *self, Py_buffer *view, PyObject *deadline_obj, Op op) {
    Progress p = {0};
    double deadline = parse_deadline(deadline_obj);
    int failed = PyErr_Occurred() || (view->len > 0 && (check_open(self) < 0 ||
        perform(self, op, view->buf, view->len, deadline, &p, op == OP_READ_ALL ? "read" : "write") < 0));
    Py_ssize_t n = view->len;
    PyBuffer_Release(view);
    if (failed) return NULL;
    if (n > 0 && p.result == ST_EOF) {
        if (op == OP_READ_ALL)
            return PyErr_Format(PyExc_EOFError, "connection closed after %zu of %zd bytes", p.done, n);
        errno = EPIPE;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *Conn_recv_exact_into(ConnObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"buffer", "deadline", NULL};
    Py_buffer view;
    PyObject *deadline_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "w*|O", kwlist, &view, &deadline_obj)) return NULL;
    return transfer_all(self, &view, deadline_obj, OP_READ_ALL);
}

static PyObject *Conn_sendall(ConnObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"data", "deadline", NULL};
    Py_buffer view;
    PyObject *deadline_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*|O", kwlist, &view, &deadline_obj)) return NULL;
    return transfer_all(self, &view, deadline_obj, OP_WRITE_ALL);
}

static PyObject *Conn_settimeout(ConnObject *self, PyObject *arg) {
    if (arg == Py_None) {
        self->timeout = -1;
        Py_RETURN_NONE;
    }
    double t = PyFloat_AsDouble(arg);
    if (t == -1 && PyErr_Occurred()) return NULL;
    if (t < 0) {
        PyErr_SetString(PyExc_ValueError, "Timeout value out of range");
        return NULL;
    }
    self->timeout = t;
    Py_RETURN_NONE;
}

static PyObject *Conn_gettimeout(ConnObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->timeout < 0) Py_RETURN_NONE;
    return PyFloat_FromDouble(self->timeout);
}

static PyObject *Conn_fileno(ConnObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLong(self->closed ? -1 : self->fd);
}

static PyObject *Conn_shutdown(ConnObject *self, PyObject *args) {
    int how;
    if (!PyArg_ParseTuple(args, "i", &how)) return NULL;
    if (self->closed || self->fd < 0 || shutdown(self->fd, how) < 0) {
        if (self->closed || self->fd < 0) errno = EBADF;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *Conn_close(ConnObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->closed) Py_RETURN_NONE;
    self->closed = 1;
    if (self->busy) {
        shutdown(self->fd, SHUT_RDWR); /* wakes the thread inside; it frees the connection on its way out */
    } else {
        release(self);
    }
    Py_RETURN_NONE;
}

static PyObject *Conn_peer_certificate(ConnObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->ssl == NULL) Py_RETURN_NONE;
    X509 *cert = SSL_get1_peer_certificate(self->ssl);
    if (cert == NULL) Py_RETURN_NONE;
    unsigned char *der = NULL;
    int len = i2d_X509(cert, &der);
    X509_free(cert);
    if (len < 0) return raise_ssl_error(ERR_get_error(), NULL, NULL), NULL;
    PyObject *out = PyBytes_FromStringAndSize((const char *)der, len);
    OPENSSL_free(der);
    return out;
}

static PyObject *Conn_version(ConnObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->ssl == NULL || !SSL_is_init_finished(self->ssl)) Py_RETURN_NONE;
    return PyUnicode_FromString(SSL_get_version(self->ssl));
}

static PyObject *Conn_cipher(ConnObject *self, PyObject *Py_UNUSED(ignored)) {
    const SSL_CIPHER *c = self->ssl ? SSL_get_current_cipher(self->ssl) : NULL;
    if (c == NULL) Py_RETURN_NONE;
    return Py_BuildValue("(ssi)", SSL_CIPHER_get_name(c), SSL_CIPHER_get_version(c), SSL_CIPHER_get_bits(c, NULL));
}

static PyObject *Conn_records(ConnObject *self, PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("(sKK)", self->sealed ? "sealed" : "tls", (unsigned long long)self->seal_epoch,
                         (unsigned long long)self->open_epoch);
}

static PyMethodDef Conn_methods[] = {
    {"records", (PyCFunction)Conn_records, METH_NOARGS,
     "(kind, keys used sending, keys used receiving): kind 'sealed' (sealed records, see _tls.c) or 'tls'."},
    {"do_handshake", (PyCFunction)Conn_do_handshake, METH_NOARGS, "Complete the TLS handshake (checks the peer)."},
    {"recv_into", (PyCFunction)(void (*)(void))Conn_recv_into, METH_VARARGS | METH_KEYWORDS,
     "recv_into(buffer, nbytes=0) -> int: at least one byte, as a socket's; 0 at end of stream."},
    {"recv", (PyCFunction)Conn_recv, METH_VARARGS, "recv(n) -> bytes: up to n bytes; b'' at end of stream."},
    {"recv_exact_into", (PyCFunction)(void (*)(void))Conn_recv_exact_into, METH_VARARGS | METH_KEYWORDS,
     "recv_exact_into(buffer, deadline=None): fill buffer; EOFError if the peer closes first, TimeoutError\n"
     "when no byte arrives within the timeout or the whole call passes ``deadline`` (time.monotonic())."},
    {"sendall", (PyCFunction)(void (*)(void))Conn_sendall, METH_VARARGS | METH_KEYWORDS,
     "sendall(data, deadline=None): send every byte (same timeout and deadline rules as recv_exact_into)."},
    {"settimeout", (PyCFunction)Conn_settimeout, METH_O, "settimeout(seconds|None): the longest wait for progress."},
    {"gettimeout", (PyCFunction)Conn_gettimeout, METH_NOARGS, "The timeout set by settimeout (None: none)."},
    {"fileno", (PyCFunction)Conn_fileno, METH_NOARGS, "The socket's file descriptor (-1 once closed)."},
    {"shutdown", (PyCFunction)Conn_shutdown, METH_VARARGS, "shutdown(how): shut the TCP socket down (wakes waiters)."},
    {"close", (PyCFunction)Conn_close, METH_NOARGS, "Close the connection (deferred while another thread is in it)."},
    {"peer_certificate", (PyCFunction)Conn_peer_certificate, METH_NOARGS, "The peer's certificate (DER) or None."},
    {"version", (PyCFunction)Conn_version, METH_NOARGS, "The negotiated protocol, e.g. 'TLSv1.3'."},
    {"cipher", (PyCFunction)Conn_cipher, METH_NOARGS, "(name, protocol, secret bits) of the negotiated cipher."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ConnType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hybridfleet.ps.wire._tls.Connection",
    .tp_doc = "Connection(context, fd, server_hostname=None): TLS over a connected socket it now owns.",
    .tp_basicsize = sizeof(ConnObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Conn_init,
    .tp_dealloc = (destructor)Conn_dealloc,
    .tp_methods = Conn_methods,
};

/* ------------------------------------------------------- the cipher's own cost
 * What the TLS connections' cipher costs by itself in the OpenSSL this module links: AES-256-GCM
 * sealing and then opening ``total`` bytes in records of ``record`` bytes (TLS's record size by
 * default), each record with its own EVP calls as a TLS record layer makes them. For benchmarks
 * (bench/tls_cost.py): nothing is kept secret, the key and nonce are fixed. */
static PyObject *mod_seal_open(PyObject *Py_UNUSED(module), PyObject *args) {
    Py_ssize_t total, record = 16384;
    if (!PyArg_ParseTuple(args, "n|n", &total, &record)) return NULL;
    if (total < 0 || record <= 0 || record > (1 << 20))
        return PyErr_Format(PyExc_ValueError, "seal_open needs total >= 0 and 0 < record <= 1 MiB (got %zd, %zd)",
                            total, record);
    unsigned char key[32], iv[12], tag[16];
    memset(key, 7, sizeof key);
    memset(iv, 9, sizeof iv);
    unsigned char *plain = calloc(1, (size_t)record), *sealed = malloc((size_t)record + 16);
    EVP_CIPHER_CTX *enc = EVP_CIPHER_CTX_new(), *dec = EVP_CIPHER_CTX_new();
    int ok = plain && sealed && enc && dec && EVP_EncryptInit_ex(enc, EVP_aes_256_gcm(), NULL, key, iv) == 1 &&
             EVP_DecryptInit_ex(dec, EVP_aes_256_gcm(), NULL, key, iv) == 1;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t done = 0; ok && done < total; done += record) {
            int n = (int)(total - done < record ? total - done : record), len = 0, last = 0;
            ok = EVP_EncryptInit_ex(enc, NULL, NULL, NULL, iv) == 1 && EVP_EncryptUpdate(enc, sealed, &len, plain, n) == 1 &&
                 EVP_EncryptFinal_ex(enc, sealed + len, &last) == 1 &&
                 EVP_CIPHER_CTX_ctrl(enc, EVP_CTRL_GCM_GET_TAG, sizeof tag, tag) == 1 &&
                 EVP_DecryptInit_ex(dec, NULL, NULL, NULL, iv) == 1 && EVP_DecryptUpdate(dec, plain, &len, sealed, n) == 1 &&
                 EVP_CIPHER_CTX_ctrl(dec, EVP_CTRL_GCM_SET_TAG, sizeof tag, tag) == 1 &&
                 EVP_DecryptFinal_ex(dec, plain + len, &last) == 1; /* the tag checks: opened what it sealed */
        }
        Py_END_ALLOW_THREADS
    }
    free(plain);
    free(sealed);
    EVP_CIPHER_CTX_free(enc);
    EVP_CIPHER_CTX_free(dec);
    if (!ok) {
        ERR_clear_error();
        PyErr_SetString(PyExc_RuntimeError, "AES-256-GCM failed to seal or open a record in this OpenSSL");
        return NULL;
    }
    return PyLong_FromSsize_t(total);
}

static PyObject *mod_set_rekey_bytes(PyObject *Py_UNUSED(module), PyObject *arg) {
    unsigned long long n = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    if (n == 0) return PyErr_Format(PyExc_ValueError, "rekey interval must be at least one byte");
    unsigned long long old = sealed_rekey_bytes;
    sealed_rekey_bytes = n;
    return PyLong_FromUnsignedLongLong(old);
}

static PyMethodDef module_methods[] = {
    {"_set_rekey_bytes", mod_set_rekey_bytes, METH_O,
     "_set_rekey_bytes(n) -> previous: sealed records change keys every n bytes each way (tests; both ends)."},
    {"seal_open", mod_seal_open, METH_VARARGS,
     "seal_open(total, record=16384) -> total: AES-256-GCM seals and opens total bytes in records of\n"
     "record bytes with this module's OpenSSL (the cipher's own cost, for benchmarks)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tls", "TLS connections whose record loop runs in C (see hybridfleet.ps.wire.tls).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__tls(void) {
    PyObject *ssl = PyImport_ImportModule("ssl");
    if (ssl == NULL) return NULL;
    SSLError = PyObject_GetAttrString(ssl, "SSLError");
    SSLCertVerificationError = PyObject_GetAttrString(ssl, "SSLCertVerificationError");
    SSLEOFError = PyObject_GetAttrString(ssl, "SSLEOFError");
    Py_DECREF(ssl);
    if (!SSLError || !SSLCertVerificationError || !SSLEOFError) return NULL;
    reader_method = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "hybridfleet socket reader");
    if (reader_method == NULL || !BIO_meth_set_read(reader_method, reader_read) ||
        !BIO_meth_set_ctrl(reader_method, reader_ctrl) || !BIO_meth_set_create(reader_method, reader_create)) {
        PyErr_SetString(PyExc_ImportError, "OpenSSL could not create the reader BIO method");
        return NULL;
    }
    ContextType.tp_new = PyType_GenericNew;
    ConnType.tp_new = PyType_GenericNew;
    if (PyType_Ready(&ContextType) < 0 || PyType_Ready(&ConnType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&ContextType);
    Py_INCREF(&ConnType);
    if (PyModule_AddObject(m, "Context", (PyObject *)&ContextType) < 0 ||
        PyModule_AddObject(m, "Connection", (PyObject *)&ConnType) < 0 ||
        PyModule_AddStringConstant(m, "OPENSSL_VERSION", OpenSSL_version(OPENSSL_VERSION)) < 0 ||
        PyModule_AddIntConstant(m, "SEALED_MAX_RECORD", SEALED_MAX_RECORD) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
