import time
from hybridfleet.store import open_store
pytest_plugins = ["tests.seaweed"]
def test_x(seaweed, s3_url):
    for i in range(3):
        t=time.perf_counter(); st = open_store(s3_url, **seaweed.options); a=time.perf_counter()-t
        t=time.perf_counter(); st.ls(""); b=time.perf_counter()-t
        t=time.perf_counter(); st.put_bytes("x", b"1"); c=time.perf_counter()-t
        t=time.perf_counter(); st.exists("y"); d=time.perf_counter()-t
        print("open", round(a,3), "ls", round(b,3), "put", round(c,3), "exists", round(d,3))
