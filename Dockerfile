# opgate: the sidecar image. Build: docker build -t opgate .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY examples ./examples
# with the capture extra (mitmproxy), so --capture works in the image
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[capture]"

FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY policies /etc/opgate/policies
# distroless-style non-root user; opgate needs no privileges and writes nothing to disk but
# what --audit-log / --capture ask for (the chart mounts an emptyDir for them)
USER 65532:65532
ENV PYTHONUNBUFFERED=1
EXPOSE 8001 9091
ENTRYPOINT ["opgate"]
# the policies come from the pod (the chart mounts a ConfigMap and passes --policies); with none,
# opgate relays every call as it is (metrics, access log). /etc/opgate/policies holds the repo's
# demo and example policies to try: the examples' identity policy admits only its own callers.
CMD ["serve"]
