package dev.cbserve.client;

import io.grpc.Attributes;
import io.grpc.EquivalentAddressGroup;
import io.grpc.NameResolver;
import io.grpc.NameResolverProvider;
import io.grpc.NameResolverRegistry;
import io.grpc.Status;
import io.grpc.StatusOr;
import java.net.InetSocketAddress;
import java.net.SocketAddress;
import java.net.URI;
import java.util.ArrayList;
import java.util.Collection;
import java.util.List;

/**
 * A fixed list of server addresses as a gRPC name resolver, so that a channel balances over them
 * with gRPC's own load-balancing policy (grpc-java resolves only DNS names, one per target). The
 * target is {@code cbserve-static:///host1:port1,host2:port2}; the registry holds only this
 * scheme and is the channel's own, so nothing global is registered.
 */
final class StaticAddresses extends NameResolverProvider {
  static final String SCHEME = "cbserve-static";

  private StaticAddresses() {}

  /** The channel target for these addresses ({@code host:port} each). */
  static String target(List<String> addresses) {
    for (String address : addresses) {
      parse(address); // fail at build time, not at the first call
    }
    return SCHEME + ":///" + String.join(",", addresses);
  }

  /** A registry that resolves {@link #SCHEME} targets only. */
  static NameResolverRegistry registry() {
    NameResolverRegistry registry = new NameResolverRegistry();
    registry.register(new StaticAddresses());
    return registry;
  }

  /** {@code host:port} or {@code [ipv6]:port}, as an unresolved address. */
  static InetSocketAddress parse(String address) {
    URI uri = URI.create("//" + address);
    if (uri.getHost() == null || uri.getPort() < 0 || !address.equals(uri.getRawAuthority())) {
      throw new IllegalArgumentException(
          "address must be host:port (or [ipv6]:port), got \"" + address + "\"");
    }
    return InetSocketAddress.createUnresolved(uri.getHost(), uri.getPort());
  }

  @Override
  public NameResolver newNameResolver(URI targetUri, NameResolver.Args args) {
    if (!SCHEME.equals(targetUri.getScheme())) {
      return null;
    }
    String path = targetUri.getPath();
    List<String> addresses = List.of(path.substring(path.startsWith("/") ? 1 : 0).split(","));
    return new Resolver(addresses);
  }

  @Override
  public String getDefaultScheme() {
    return SCHEME;
  }

  @Override
  protected boolean isAvailable() {
    return true;
  }

  @Override
  protected int priority() {
    return 5;
  }

  @Override
  public Collection<Class<? extends SocketAddress>> getProducedSocketAddressTypes() {
    return List.of(InetSocketAddress.class);
  }

  /** Resolves each address's host (DNS for a name) whenever gRPC asks, e.g. after a failure. */
  private static final class Resolver extends NameResolver {
    private final List<String> addresses;
    private Listener2 listener;

    Resolver(List<String> addresses) {
      this.addresses = addresses;
    }

    @Override
    public String getServiceAuthority() {
      return addresses.get(0); // the TLS name; override it with the builder's authority(...)
    }

    @Override
    public void start(Listener2 listener) {
      this.listener = listener;
      resolve();
    }

    @Override
    public void refresh() {
      resolve();
    }

    private void resolve() {
      List<EquivalentAddressGroup> groups = new ArrayList<>(addresses.size());
      List<String> failed = new ArrayList<>();
      for (String address : addresses) {
        InetSocketAddress unresolved = parse(address);
        InetSocketAddress resolved =
            new InetSocketAddress(unresolved.getHostString(), unresolved.getPort());
        if (resolved.isUnresolved()) {
          failed.add(address);
        } else {
          groups.add(new EquivalentAddressGroup(resolved));
        }
      }
      if (groups.isEmpty()) {
        listener.onError(Status.UNAVAILABLE.withDescription("cannot resolve " + failed));
        return;
      }
      listener.onResult(
          ResolutionResult.newBuilder()
              .setAddressesOrError(StatusOr.fromValue(groups))
              .setAttributes(Attributes.EMPTY)
              .build());
    }

    @Override
    public void shutdown() {}
  }
}
