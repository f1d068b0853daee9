import socket
import sys
import time

"""Hold a TCP port, as another job would: python holdport.py PORT SECONDS."""
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen()
time.sleep(float(sys.argv[2]))
