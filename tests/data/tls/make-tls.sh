#!/bin/sh
# Regenerates the throw-away private CA and the 127.0.0.1 server certificate of tests/test_tls.py (valid 10 years).
# Test material only: the key signs nothing but a certificate for 127.0.0.1 and localhost.
set -e
cd "$(dirname "$0")"
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' > san.ext
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 3650 -subj "/CN=eagle-datagen-test-ca" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -keyout srv.key -out srv.csr -subj "/CN=127.0.0.1" 2>/dev/null
openssl x509 -req -in srv.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out srv.pem -days 3650 -extfile san.ext 2>/dev/null
rm -f srv.csr ca.srl san.ext ca.key
openssl x509 -in srv.pem -noout -enddate
